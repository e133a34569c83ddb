"""The router + model process: feeds requests into the engine core and runs its steps.

The core already does the Efficient Router admission (a request joins only if the batch's projected peak KV use
stays within the cache) and continuous batching; this loop adds the process plumbing: it drains its inbox without
blocking while there is work, holds back requests whose images are still being encoded, aborts on request, and
sends every step's tokens plus the occupancy stats to the detokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import zmq

from language.request import (
    MultimodalItem,
    PrefixNotCached,
    Request,
    RequestError,
    RequestOutput,
    RequestRejected,
)
from mmserve.ipc.endpoints import Endpoints
from mmserve.ipc.messages import (
    AbortRequest,
    DetokSetup,
    ImageRef,
    ImagesReady,
    ReadyInfo,
    RouterBatch,
    RouterStats,
    TokenizedRequest,
)
from mmserve.ipc.zmq_queue import PullQueue, PushQueue
from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import parent_alive, run_child, seconds_since_process_start
from visual.tower_turn import TowerTurn

logger = logging.getLogger(__name__)

_THROUGHPUT_LOG_S = 5.0  # how often a busy router logs its throughput
_IDLE_POLL_MS = 500  # how often an idle router checks that its parent is still there
_TOWER_POLL_MS = 1  # while holding a step back for the vision tower: how often its flag is read
_MAX_EARLY_READY = 10_000  # ImagesReady seen before (or without) their request: kept boundedly
# A step prefilling at least this many prompt tokens runs for tens of ms (~25 ms per 1k tokens for a 7B on an H100):
# the next step is planned only once it is done, so that prompts arriving meanwhile join that next step.
_PLAN_AFTER_PROMPT_TOKENS = 1024

# Reads one image's embeddings from the shared-memory cache: [num_tokens, hidden].
EmbedReader = Callable[[ImageRef], torch.Tensor]


class EmbeddingMissing(LookupError):
    """An image's embeddings are not in the cache when the router reads them. The HTTP side holds a request's
    entries until the router reports it ended, so this is a bug: the request fails alone, the router goes on."""

    def __init__(self, rid: str, key: str):
        super().__init__(f"request {rid}: the embeddings of image {key} are no longer in the embedding cache")
        self.rid, self.key = rid, key


class Router:
    def __init__(
        self,
        core,
        embed_reader: EmbedReader | None = None,
        tower_turn: TowerTurn | None = None,
        tower_turn_s: float = 0.0,
        tower_lookahead_tokens: int = 0,
    ):
        self.core = core
        self._embed_reader = embed_reader
        self._tower_turn = tower_turn if tower_turn_s > 0 else None
        self._tower_turn_s = tower_turn_s
        self._backlog_to = tower_turn if tower_lookahead_tokens > 0 else None  # where the visual process reads it
        self._backlog_cap = tower_lookahead_tokens  # the tower holds at this backlog: no need to count further
        self._awaiting_images: dict[str, TokenizedRequest] = {}
        self._early_ready: OrderedDict[str, str | None] = OrderedDict()
        self._live: set[str] = set()  # rids inside the engine core
        self._setups: list[DetokSetup] = []
        self._own_outputs: list[RequestOutput] = []  # outputs the router makes itself (rejections, early aborts)
        self._encode_needed: list[str] = []  # for the next batch: requests whose unembedded images must be encoded
        self._abort_issued = False  # the core owes us the final output of an aborted request
        self._last_stats: RouterStats | None = None
        self._first_token_pending: dict[str, float] = {}  # rid -> arrival (perf_counter), DEBUG logging only

    # ------------------------------------------------------------------------------------------ inbox

    def handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedRequest):
            self._on_request(msg)
        elif isinstance(msg, AbortRequest):
            self._on_abort(msg.rid)
        elif isinstance(msg, ImagesReady):
            self._on_images_ready(msg)
        else:
            raise TypeError(f"router got {type(msg).__name__}")

    def _on_request(self, msg: TokenizedRequest) -> None:
        if logger.isEnabledFor(logging.DEBUG):  # with the HTTP side's `request timing` lines: where a TTFT goes
            self._first_token_pending[msg.rid] = time.perf_counter()
        self._setups.append(DetokSetup.of(msg))
        if msg.wait_for_images:
            if msg.rid not in self._early_ready:
                self._awaiting_images[msg.rid] = msg
                return
            error = self._early_ready.pop(msg.rid)
            if error is not None:
                self._reject(msg.rid, len(msg.prompt_ids), _encoding_failed(error))
                return
        self._admit(msg)

    def _on_images_ready(self, msg: ImagesReady) -> None:
        req = self._awaiting_images.pop(msg.rid, None)
        if req is None:  # the request is still on its way (or was aborted meanwhile)
            self._early_ready[msg.rid] = msg.error
            while len(self._early_ready) > _MAX_EARLY_READY:
                self._early_ready.popitem(last=False)
        elif msg.error is not None:
            self._reject(req.rid, len(req.prompt_ids), _encoding_failed(msg.error))
        else:
            self._admit(req, all_embedded=True)

    def _on_abort(self, rid: str) -> None:
        req = self._awaiting_images.pop(rid, None)
        if req is not None:
            self._own_outputs.append(RequestOutput(rid, [], [], True, "abort", len(req.prompt_ids), 0))
        elif rid in self._live:
            self.core.abort(rid)
            self._abort_issued = True
        self._early_ready.pop(rid, None)

    def _admit(self, msg: TokenizedRequest, all_embedded: bool = False) -> None:
        """Into the engine. Images the HTTP server sent without embeddings (evicted from the embedding cache since
        they were seen) go in without them if the prefix cache holds their KV; otherwise the request waits here
        while the HTTP server encodes them (`all_embedded` once it has: ImagesReady)."""
        try:
            self.core.add_request(self._engine_request(msg, all_embedded))
        except PrefixNotCached:
            self._awaiting_images[msg.rid] = msg
            self._encode_needed.append(msg.rid)
            return
        except RequestRejected as e:  # can never fit (too long for the cache or the model), or bad parameters
            self._reject(msg.rid, len(msg.prompt_ids), e.error)
            return
        except ValueError as e:  # what the model finds wrong with the prompt (its images' grids, say)
            self._reject(msg.rid, len(msg.prompt_ids), RequestError.refused("inputs", str(e)))
            return
        except EmbeddingMissing as e:  # a bug, not the client's fault: this request fails with a 500, not the router
            logger.error("%s; the request fails", e)
            self._reject(msg.rid, len(msg.prompt_ids), RequestError.server_failure(str(e)))
            return
        except Exception as e:  # anything else while admitting it: this request fails, not the router
            logger.exception("request %s could not be admitted", msg.rid)
            self._reject(msg.rid, len(msg.prompt_ids), RequestError.server_failure(f"{type(e).__name__}: {e}"))
            return
        self._live.add(msg.rid)

    def _engine_request(self, msg: TokenizedRequest, all_embedded: bool = False) -> Request:
        items = []
        if msg.images:
            if self._embed_reader is None:
                raise ValueError("this server has no image support (start it with --enable_multimodal)")
            items = [
                MultimodalItem(r.offset, self._read_embeds(msg.rid, r) if r.embedded or all_embedded else None, r.key,
                               r.grid_thw, length=r.num_tokens, second_per_grid_t=r.second_per_grid_t,
                               row_start=r.row_start)
                for r in msg.images
            ]  # fmt: skip
        # Families with multi-axis positions (Qwen2-VL) derive them from the prompt and the image grids in the engine.
        return Request(msg.rid, list(msg.prompt_ids), msg.params, items)

    def _read_embeds(self, rid: str, ref: ImageRef) -> torch.Tensor:
        try:
            embeds = self._embed_reader(ref)
        except FileNotFoundError:  # its shared-memory segment was unlinked: the entry was evicted
            raise EmbeddingMissing(rid, ref.key) from None
        end = ref.row_start + ref.num_tokens
        if embeds.shape[0] < end:  # a bug: the prompt was expanded for more rows than the entry holds
            raise RuntimeError(f"image {ref.key}: rows {ref.row_start}:{end} asked of an entry of {embeds.shape[0]}")
        if embeds.shape[0] != ref.num_tokens:  # one of a video's runs (Qwen3-VL: one run per temporal patch)
            embeds = embeds[ref.row_start : end]
        return embeds

    def _reject(self, rid: str, prompt_tokens: int, error: RequestError) -> None:
        self._own_outputs.append(RequestOutput(rid, [], [], True, "error", prompt_tokens, 0, error=error))

    # ------------------------------------------------------------------------------------------- steps

    def has_work(self) -> bool:
        return bool(
            self.core.has_unfinished() or self._abort_issued or self._own_outputs or self._setups or self._encode_needed
        )

    def step(self, send: Callable[[RouterBatch], None] | None = None) -> RouterBatch | None:
        """One engine step (if anything runs); the batch for the detokenizer, or None if nothing changed.
        send: where a batch goes before a prompt step is launched (the previous step's tokens, then, go out before
        the host spends tens of ms launching it); the rest is returned."""
        own, self._own_outputs = self._own_outputs, []
        if not (self.core.has_unfinished() or self._abort_issued):
            return self._batch(own)
        self._abort_issued = False

        def emit(early: list[RequestOutput]) -> None:
            nonlocal own
            batch = self._batch(own + early)
            own = []
            if batch is not None:
                send(batch)

        late = self.core.step(emit if send is not None else None)
        return self._batch(own + late)

    def _batch(self, outputs: list[RequestOutput]) -> RouterBatch | None:
        """The detokenizer's batch: these outputs, the setups of requests that arrived since the last batch (before
        any of their tokens), the requests whose images must be encoded, and the stats if they changed."""
        for out in outputs:
            if out.finished:
                self._live.discard(out.rid)
            if self._first_token_pending and (out.new_token_ids or out.finished):
                arrived = self._first_token_pending.pop(out.rid, None)
                if arrived is not None:
                    logger.debug("router timing: rid=%s arrived=%.4f first_token_ms=%.1f cached=%d", out.rid, arrived,
                                 (time.perf_counter() - arrived) * 1e3, out.cached_tokens)  # fmt: skip
        stats = self.stats()
        setups, self._setups = self._setups, []
        needed, self._encode_needed = self._encode_needed, []
        if not setups and not outputs and not needed and stats == self._last_stats:
            return None
        self._last_stats = stats
        return RouterBatch(setups=setups, outputs=outputs, stats=stats, encode_needed=needed)

    def _give_tower_its_turn(self, inbox: PullQueue) -> None:
        """While the vision tower runs a batch, hold back a step that would only decode (at most tower_turn_s), so
        the tower has the GPU to itself; messages are handled meanwhile, and a prompt to prefill ends the wait."""
        turn = self._tower_turn
        if turn is None or not turn.is_up() or not self.core.has_unfinished() or self.core.has_prompt_work():
            return
        deadline = time.perf_counter() + self._tower_turn_s
        self.core.counters.tower_waits += 1
        while turn.is_up() and not self.core.has_prompt_work() and time.perf_counter() < deadline:
            for msg in inbox.drain(_TOWER_POLL_MS):
                self.handle(msg)

    def publish_backlog(self) -> None:
        """Tell the visual process how many prompt tokens wait for prefill (it holds its next tower batch at
        --tower_lookahead_tokens: visual/tower_turn.py)."""
        if self._backlog_to is not None:
            self._backlog_to.publish_backlog(self.core.prompt_backlog(self._backlog_cap))

    def _plan_after_long_step(self, inbox: PullQueue) -> None:
        """The overlapped loop plans step N+1 while step N runs, so a prompt that arrives during N waits for N+1
        and joins N+2: two steps, ~200 ms behind two 4096-token chunks. While a long prompt step runs, wait for it
        here instead, handling messages meanwhile: the newcomers then join N+1. The device idles only while N+1
        is planned and staged; short (decode) steps stay overlapped. Under a flood of prompts the wait is skipped:
        when the prompts already queued fill N+1's prefill budget, a newcomer could not join N+1 anyway, and
        planning N+1 while N runs hides its host time (~20 ms for a 4096-token eager step, which the device would
        otherwise idle through after every chunk)."""
        core = self.core
        while not core.prompt_backlog_fills_step() and core.prompt_tokens_in_flight() >= _PLAN_AFTER_PROMPT_TOKENS:
            for msg in inbox.drain(0):
                self.handle(msg)

    def stats(self) -> RouterStats:
        return RouterStats(self.core.stats(), len(self._awaiting_images))

    def serve(self, inbox: PullQueue, to_detok: PushQueue, parent_pid: int) -> None:
        last_log, logged = time.monotonic(), dataclasses.replace(self.core.counters)
        while parent_alive(parent_pid):
            for msg in inbox.drain(0 if self.has_work() else _IDLE_POLL_MS):
                self.handle(msg)
            self._give_tower_its_turn(inbox)
            self._plan_after_long_step(inbox)
            batch = self.step(to_detok.send)
            if batch is not None:
                to_detok.send(batch)
            self.publish_backlog()
            now = time.monotonic()
            if now - last_log >= _THROUGHPUT_LOG_S and self.core.counters.steps != logged.steps:
                logger.info("%s; %s", self.core.counters.summary(logged, now - last_log), self.stats())
                last_log, logged = now, dataclasses.replace(self.core.counters)
        logger.info("parent process is gone; router exits")


def _encoding_failed(error: str) -> RequestError:
    return RequestError.refused("inputs", f"image encoding failed: {error}")


# ------------------------------------------------------------------------------------------------ process


def ready_info(core) -> ReadyInfo:
    info = core.model_info
    return ReadyInfo(
        process="router",
        max_total_token_num=int(info.max_total_token_num),
        max_req_total_len=int(info.max_req_total_len),
        eos_token_ids=tuple(int(t) for t in info.eos_token_ids),
        vocab_size=int(info.vocab_size),
        architecture=str(info.architecture),
        dtype=str(info.dtype).removeprefix("torch."),
        device=str(info.device),
    )


def run_router_process(
    config: ServerConfig,
    endpoints: Endpoints,
    embed_reader: EmbedReader | None,
    tower_turn: TowerTurn | None,
    ready: Connection,
) -> None:
    """Process entry: load the model, report ready, then serve until the parent goes away or sends SIGTERM."""

    def start():
        from language.engine import EngineCore
        from mmserve.prep.tokenizers.grammar_vocab import grammar_vocabulary

        logger.info("engine modules imported after %.1f s", seconds_since_process_start())
        core = EngineCore(config.engine_config(), grammar_vocabulary(config.model_dir, config.trust_remote_code))
        if core.model_info.device.type == "cuda" or config.tp > 1:
            # (On CPU, tensor-parallel ranks share the cores: one thread each.)
            # Host work per step is many tiny tensor ops: a thread pool per op only adds wake-up latency and fights
            # the other processes for cores.
            torch.set_num_threads(1)
        router = Router(core, embed_reader, tower_turn, config.tower_turn_ms / 1e3, config.tower_lookahead_tokens)
        ctx = zmq.Context()
        inbox = PullQueue(ctx, endpoints.router)
        to_detok = PushQueue(ctx, endpoints.detokenizer)
        info = ready_info(core)
        logger.info(
            "model loaded: %s %s on %s, %d KV token slots, requests up to %d tokens (prompt + output)",
            info.architecture,
            info.dtype,
            info.device,
            info.max_total_token_num,
            info.request_limit,
        )

        def serve(parent_pid: int) -> None:
            try:
                router.serve(inbox, to_detok, parent_pid)
            finally:
                inbox.close()
                to_detok.close()
                ctx.term()

        return info, serve

    run_child("router", config.log_level, ready, start)
