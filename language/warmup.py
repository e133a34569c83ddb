"""Compiling every Triton specialization before the first request. Triton specialises integer arguments that are 1
or multiples of 16, so a server that meets a new (token count, longest sequence, sequence count) class mid-load
would stall that step for a compile; we meet each class once at start-up instead, through the engine's own step
(prefill-only steps, then steps that mix decode rows with new prompts)."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol

import torch

from language.kernels.precompile import compile_only
from language.kv_cache import KVCache
from language.prefix_cache import PrefixCache
from language.progress import progress
from language.request import MultimodalItem, Request
from language.sampling_params import SamplingParams
from language.scheduler import Scheduler

logger = logging.getLogger(__name__)


class _Shapes(Protocol):
    mm_embed_width: int
    dtype: torch.dtype
    device: torch.device
    max_req_total_len: int


class WarmedEngine(Protocol):
    """What warm-up drives: language.engine.EngineCore, which calls warmup(self) and so is not imported here."""

    model: Any  # the decoder (its position_dims)
    model_info: _Shapes
    kv: KVCache
    prefix: PrefixCache | None
    scheduler: Scheduler
    counters: Any

    def add_request(self, req: Request) -> None: ...

    def step(self) -> Any: ...

    def has_unfinished(self) -> bool: ...


def _kind(x: int) -> int:
    return 1 if x == 1 else 16 if x % 16 == 0 else 0


def warmup_shapes() -> list[list[int]]:
    """Prompt-length lists that together cover every (kind of total, kind of longest, kind of count)."""
    wanted = {(a, b, c) for a in (0, 1, 16) for b in (0, 1, 16) for c in (0, 1, 16)}
    found: dict[tuple[int, int, int], list[int]] = {}
    for count, longest, rest in itertools.product((1, 2, 3, 16, 17, 32), (1, 5, 16, 17, 32), (1, 2, 3, 7, 16)):
        lens = [longest] + [min(rest, longest)] * (count - 1)
        key = (_kind(sum(lens)), _kind(longest), _kind(count))
        if key in wanted and key not in found:
            found[key] = lens
    return list(found.values())


def _request(engine: WarmedEngine, rid: str, length: int, new_tokens: int, with_image: bool) -> Request:
    req = Request(rid, [0] * length, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    if with_image:  # the splice kernel too; made-up images keep plain positions
        embeds = torch.zeros(length, engine.model_info.mm_embed_width, dtype=engine.model_info.dtype)
        req.mm_items.append(MultimodalItem(offset=0, embeds=embeds))
        if engine.model.position_dims > 1:
            req.positions = torch.arange(length).expand(engine.model.position_dims, -1)
    return req


def _run(engine: WarmedEngine, waves: list[list[Request]]) -> None:
    """Add each wave one step after the previous one, then step until all have finished."""
    for wave in waves:
        for r in wave:
            engine.add_request(r)
        engine.step()
    while engine.has_unfinished():
        engine.step()


@torch.inference_mode()
def warmup(engine: WarmedEngine) -> None:
    """Every shape class once: first with launches that only compile (all variants at once, in parallel; what
    those steps compute is garbage), then for real, each variant compiled. The prefix cache forgets both passes'
    made-up prompts, so the server starts with it empty, as its metrics say."""
    with compile_only("kernel warm-up"):
        _warm(engine)
    _forget_prompts(engine)
    _warm(engine)
    _forget_prompts(engine)
    engine.counters = type(engine.counters)()  # the figures start with the first real request


def _forget_prompts(engine: WarmedEngine) -> None:
    """Evict the warm-up's prompts and answers from the prefix cache, and zero its hit count (a total since the
    server started serving: `mmserve_prefix_cache_hit_tokens_total`)."""
    if engine.prefix is not None:
        engine.prefix.clear()
        engine.prefix.hit_tokens = 0


def _warm(engine: WarmedEngine) -> None:
    free = engine.kv.slots.num_free
    shapes = warmup_shapes()
    for i, lens in progress(enumerate(shapes), len(shapes), "warming up kernels", logger):
        if sum(lens) + len(lens) > free or len(lens) > engine.kv.num_free_rows():
            continue
        _run(engine, [[_request(engine, f"warmup-{i}-{j}", n, 1, i < 2) for j, n in enumerate(lens)]])
    # Decode rows of each count kind beside new prompts (one long enough to be split, so a chunk runs behind a
    # cached prefix), then decode alone.
    waves = [
        [_request(engine, f"warmup-mix-{w}-{j}", 5 + j, 6, False) for j in range(n)]
        for w, n in enumerate((1, 16, 2, 3, 5))
    ]
    long_len = engine.scheduler.prefill_budget + 37
    if long_len + 8 <= engine.model_info.max_req_total_len:
        waves[1].append(_request(engine, "warmup-long", long_len, 3, False))
    if sum(r.prompt_len + 6 for w in waves for r in w) <= free:
        _run(engine, waves)
    if engine.model_info.device.type == "cuda":
        torch.cuda.synchronize()
