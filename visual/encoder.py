"""The visual process's work, as a class the tests drive in-process: take encode jobs, preprocess them in the pool,
run ready images through the vision model in batches, write the embeddings into the shared-memory cache, and report
each key as done or failed."""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait

from cache.shm_store import write_embedding
from mmserve.multimodal.image_io import BadImage
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualResult
from visual.models.base import ImageInput
from visual.preprocess import PreprocessPool

logger = logging.getLogger(__name__)


class VisualEncoder:
    def __init__(self, model, pool: PreprocessPool, shm_prefix: str, max_batch: int = 16):
        self.model = model
        self.pool = pool
        self.shm_prefix = shm_prefix
        self.max_batch = max_batch
        self._preprocessing: deque[tuple[str, Future[ImageInput]]] = deque()  # in arrival order
        self.images_encoded = 0

    def submit(self, job: EncodeJob) -> None:
        self._preprocessing.append((job.key, self.pool.submit(job.data)))

    def has_work(self) -> bool:
        return bool(self._preprocessing)

    def step(self, timeout_s: float = 0.0) -> list[VisualResult]:
        """Encode what is preprocessed (waiting up to timeout_s for the first image); one batch at most."""
        if not self._preprocessing:
            return []
        if not any(f.done() for _, f in self._preprocessing):
            wait([f for _, f in self._preprocessing], timeout=timeout_s, return_when=FIRST_COMPLETED)
        results: list[VisualResult] = []
        batch: list[tuple[str, ImageInput]] = []
        waiting: deque[tuple[str, Future[ImageInput]]] = deque()
        for key, fut in self._preprocessing:
            if not fut.done() or len(batch) >= self.max_batch:
                waiting.append((key, fut))
            elif (err := fut.exception()) is not None:
                results.append(EncodeFailed(key, str(err), bad_image=isinstance(err, BadImage)))
            else:
                batch.append((key, fut.result()))
        self._preprocessing = waiting
        if batch:
            results += self._encode(batch)
        return results

    def _encode(self, batch: list[tuple[str, ImageInput]]) -> list[VisualResult]:
        start = time.perf_counter()
        try:
            embeds = self.model.encode([image for _, image in batch])  # each [num_tokens, hidden] on the device
            for (key, image), emb in zip(batch, embeds, strict=True):
                if emb.shape[0] != image.num_tokens:
                    raise RuntimeError(f"{emb.shape[0]} embeddings for an image of {image.num_tokens} tokens")
                write_embedding(self.shm_prefix, key, emb)  # device -> shm: synchronous
        except Exception as e:  # the model or the shared memory failed: these keys fail, the process goes on
            logger.exception("encoding %d images failed", len(batch))
            return [EncodeFailed(key, f"{type(e).__name__}: {e}", bad_image=False) for key, _ in batch]
        self.images_encoded += len(batch)
        logger.debug("encoded %d images in %.1f ms", len(batch), 1e3 * (time.perf_counter() - start))
        return [EncodeDone(key, image.num_tokens) for key, image in batch]

    def shutdown(self) -> None:
        self.pool.shutdown()
