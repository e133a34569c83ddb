"""The visual process's work, as a class the tests drive in-process: take encode jobs, preprocess them in the pool,
run ready images through the vision model in batches, write the embeddings into the shared-memory cache, and report
each key as done or failed.

A batch's embeddings leave the GPU in one asynchronous copy into a pinned host buffer (one sync for the batch, at
full bus speed), and are then copied into their shared-memory segments on the CPU. Writing GPU tensors into the
segments directly would be one synchronous, pageable copy per image."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from queue import SimpleQueue

import torch

from visual.image_decode import BadImage
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualResult
from visual.models.base import ImageInput
from visual.preprocess import PreprocessPool
from visual.spare_segments import SpareSegments
from visual.staging import HostStaging, in_parallel
from visual.stats import VisionStats
from visual.tower_turn import TowerTurn

logger = logging.getLogger(__name__)

_HOLD_POLL_S = 0.001  # how often a held batch looks at the router's backlog again (a 4096-token chunk: ~90 ms)
_MAX_HOLD_S = 1.0  # the longest a batch is held (an 8192-token backlog prefills in ~0.2 s on an H100)


class VisualEncoder:
    """`submit` may be called from any thread (the visual process receives jobs on its own thread, so that the pool
    starts on an image while the tower runs); `step`, `has_work` and `shutdown` from one thread only."""

    def __init__(
        self,
        model,
        pool: PreprocessPool,
        shm_prefix: str,
        max_batch: int,
        turn: TowerTurn | None = None,
        max_batch_patches: int = 0,
        batch_wait_s: float = 0.0,
        lookahead_tokens: int = 0,
    ):
        """max_batch: images per tower batch; max_batch_patches: the positions the tower runs over for them (0: no
        limit), so that large images go through in small batches, each one's embeddings reaching the LM as soon as
        its batch ends; batch_wait_s: how long a batch that is not full waits for images still being preprocessed
        (`_wait_for_stragglers`); lookahead_tokens: the router's backlog of prompt tokens at which the next batch is
        held (`_hold_for_the_lm`; 0: never)."""
        self.model = model
        self.turn = turn  # raised while a batch runs: the router holds back decode-only steps meanwhile
        self.pool = pool
        self.shm_prefix = shm_prefix
        self.max_batch = max_batch
        self.max_batch_patches = max_batch_patches
        self.batch_wait_s = batch_wait_s
        self.lookahead_tokens = lookahead_tokens
        self._incoming: SimpleQueue[tuple[str, float, Future[ImageInput]]] = SimpleQueue()  # filled by `submit`
        self._preprocessing: deque[tuple[str, float, Future[ImageInput]]] = deque()  # in arrival order
        self._wake = threading.Event()  # set when a job arrives or an image finishes preprocessing
        self._embeds = HostStaging()  # pinned on CUDA: the batch's embeddings on their way to shared memory
        self._segments = SpareSegments(shm_prefix)  # where they go: segments made ahead, so a write is a memcpy
        self.stats = VisionStats()
        self.images_encoded = 0

    def submit(self, job: EncodeJob) -> None:
        arrived = time.perf_counter()
        fut = self.pool.submit(job.data, job.video, job.options)
        self._incoming.put((job.key, arrived, fut))
        fut.add_done_callback(self._on_done)
        self._wake.set()

    def _on_done(self, _: Future) -> None:
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self._preprocessing) or not self._incoming.empty()

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until a job arrives or an image is preprocessed (or timeout_s passes)."""
        self._wake.wait(timeout_s)

    def step(self, timeout_s: float = 0.0) -> list[VisualResult]:
        """Encode what is preprocessed now as one batch (continuous batching: the tower does not wait for the
        images still in the pool, but for at most batch_wait_s). With nothing ready yet, wait up to timeout_s for
        the first image."""
        self._wake.clear()  # before looking, so that a completion from here on wakes the next wait
        self._take_incoming()
        if not self._preprocessing:
            return []
        if timeout_s > 0 and not any(f.done() for _, _, f in self._preprocessing):
            wait([f for _, _, f in self._preprocessing], timeout=timeout_s, return_when=FIRST_COMPLETED)
        self._wait_for_stragglers()
        results: list[VisualResult] = []
        batch: list[tuple[str, float, ImageInput]] = []
        waiting: deque[tuple[str, float, Future[ImageInput]]] = deque()
        patches = 0
        for key, arrived, fut in self._preprocessing:
            if not fut.done() or len(batch) >= self.max_batch or self._over_budget(fut, patches, len(batch)):
                waiting.append((key, arrived, fut))
                continue
            try:
                batch.append((key, arrived, self.pool.collect(fut)))
                patches += batch[-1][2].tower_rows
            except Exception as err:
                self.stats.failed += 1
                results.append(EncodeFailed(key, str(err), bad_image=isinstance(err, BadImage)))
        self._preprocessing = waiting
        if batch:
            self._hold_for_the_lm(sum(image.num_tokens for _, _, image in batch))
            results += self._encode(batch)
        if waiting and any(f.done() for _, _, f in waiting):
            self._wake.set()  # more than max_batch were ready: the next step must not wait
        return results

    def _take_incoming(self) -> None:
        while not self._incoming.empty():
            self._preprocessing.append(self._incoming.get())

    def _wait_for_stragglers(self) -> None:
        """While the next batch is not full and images are still being preprocessed, wait for them (at most
        batch_wait_s). A small batch costs about as much host time as a full one (the tower's ~400 kernel
        launches), and the images right behind it, those of the same burst a few ms from ready, would wait for all
        of it."""
        deadline = time.perf_counter() + self.batch_wait_s
        while (left := deadline - time.perf_counter()) > 0:
            self._take_incoming()
            ready = [f for _, _, f in self._preprocessing if f.done() and f.exception() is None]
            pending = [f for _, _, f in self._preprocessing if not f.done()]
            if not ready or not pending or self._batch_full(ready):
                return
            wait(pending, timeout=left, return_when=FIRST_COMPLETED)

    def _hold_for_the_lm(self, batch_tokens: int) -> None:
        """While the router's prompts waiting for prefill hold lookahead_tokens or more, hold the batch (the pool
        goes on preprocessing): the shared GPU goes to the prompts at the front, whose images were encoded first, not
        to towers for requests behind them (visual/tower_turn.py). A batch of lookahead_tokens or more is not held:
        it takes about as long in the tower as the backlog takes to prefill, so holding it would leave the LM
        without prompts before the batch is out (a 30 s clip at 2 fps is one 15k-token batch). At most _MAX_HOLD_S:
        a backlog that does not shrink (prompts that wait for KV space) must not stop the tower."""
        if self.turn is None or not self.lookahead_tokens or batch_tokens >= self.lookahead_tokens:
            return
        start = time.perf_counter()
        while self.turn.prompt_backlog() >= self.lookahead_tokens and time.perf_counter() - start < _MAX_HOLD_S:
            time.sleep(_HOLD_POLL_S)
        self.stats.held_s += time.perf_counter() - start

    def _batch_full(self, ready: list[Future[ImageInput]]) -> bool:
        if len(ready) >= self.max_batch:
            return True
        return bool(self.max_batch_patches) and sum(f.result().tower_rows for f in ready) >= self.max_batch_patches

    def _over_budget(self, fut: Future[ImageInput], patches: int, images: int) -> bool:
        """A finished image that would take the batch past max_batch_patches (a batch's first image always fits)."""
        if not self.max_batch_patches or images == 0 or fut.exception() is not None:
            return False
        return patches + fut.result().tower_rows > self.max_batch_patches

    def _encode(self, batch: list[tuple[str, float, ImageInput]]) -> list[VisualResult]:
        start = time.perf_counter()
        arrived = [t for _, t, _ in batch]
        try:
            with self.turn.batch_running() if self.turn is not None else contextlib.nullcontext():
                embeds = self.model.encode([image for _, _, image in batch])  # each [num_tokens, hidden] on device
                for (_, _, image), emb in zip(batch, embeds, strict=True):
                    if emb.shape[0] != image.num_tokens:
                        raise RuntimeError(f"{emb.shape[0]} embeddings for an image of {image.num_tokens} tokens")
                host = self._to_host(embeds)  # each [num_tokens, hidden] in (pinned) host memory
            encoded = time.perf_counter()
            # host -> shm: a memcpy per image (into a spare segment's populated pages, where one fits)
            keys = [key for key, _, _ in batch]
            in_parallel(lambda pair: self._segments.write(*pair), zip(keys, host, strict=True))
        except Exception as e:  # the model or the shared memory failed: these keys fail, the process goes on
            logger.exception("encoding %d images failed", len(batch))
            self.stats.failed += len(batch)
            return [EncodeFailed(key, f"{type(e).__name__}: {e}", bad_image=False) for key, _, _ in batch]
        done = time.perf_counter()
        if logger.isEnabledFor(logging.DEBUG):  # a timeline of the batches, beside the router's `step timing`
            tokens = sum(image.num_tokens for _, _, image in batch)
            patches = sum(image.tower_rows for _, _, image in batch)
            decode_ms = max(image.decode_s for _, _, image in batch) * 1e3  # the slowest image's, in its worker
            preprocess_ms = max(image.preprocess_s for _, _, image in batch) * 1e3
            logger.debug("tower batch: start=%.4f encoded=%.4f done=%.4f images=%d tokens=%d patches=%d "
                         "first_arrived=%.4f decode_ms=%.1f preprocess_ms=%.1f", start, encoded, done, len(batch),
                         tokens, patches, min(arrived), decode_ms, preprocess_ms)  # fmt: skip
        self.images_encoded += len(batch)
        self.stats.add_batch(
            tower_s=encoded - start,
            write_s=done - encoded,
            decode_s=sum(im.decode_s for _, _, im in batch),
            preprocess_s=sum(im.preprocess_s for _, _, im in batch),
            latency_s=sum(done - t for t in arrived),
            images=len(batch),
        )
        per_row = (encoded - start) / sum(image.tower_rows for _, _, image in batch)  # the batch's tower time, shared
        return [
            EncodeDone(key, im.num_tokens, im.decode_s + im.preprocess_s, per_row * im.tower_rows, im.video)
            for key, _, im in batch
        ]

    def warm_up(self, embeds: list[torch.Tensor]) -> None:
        """A warm-up batch's embeddings through the copy back to the host, dropped there: sizes the pinned staging
        buffer for a full batch before the first one is served, and has spare segments made for entries of their
        size."""
        self._segments.expect(self._to_host(embeds))

    def _to_host(self, embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device embeddings -> host tensors: one non-blocking copy into the pinned staging buffer when they are
        consecutive pieces of one tensor (what every family returns), then one wait for the batch."""
        first = embeds[0]
        if first.device.type == "cpu":
            return embeds
        rows = [e.shape[0] for e in embeds]
        staging = self._embeds.take((sum(rows), *first.shape[1:]), first.dtype, first.device)  # [tokens, hidden]
        packed = consecutive_view(embeds)
        if packed is not None:
            staging.copy_(packed, non_blocking=True)
        else:  # separate tensors: still no sync in between
            for dst, src in zip(torch.split(staging, rows), embeds, strict=True):
                dst.copy_(src, non_blocking=True)
        self._embeds.fence(first.device)
        self._embeds.wait()
        return list(torch.split(staging, rows))

    def shutdown(self) -> None:
        self._take_incoming()
        for _, _, fut in self._preprocessing:  # their pixel segments must not outlive us
            self.pool.drop(fut)
        self._preprocessing.clear()
        self.pool.shutdown()
        self._segments.close()


def consecutive_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One [sum of rows, ...] view over `parts` if they lie back to back in one storage (e.g. the pieces of
    `torch.split` or `unbind(0)` of a contiguous tensor), else None."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.shape[1:] != first.shape[1:]
            or p.untyped_storage().data_ptr() != storage
            or p.data_ptr() != expected
        ):
            return None
        expected += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())
