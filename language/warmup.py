"""Compiling every Triton specialization before the first request. Triton specialises integer arguments that are 1
or multiples of 16, so a server that meets a new (token count, longest sequence, sequence count) class mid-load
would stall that step for a compile; we meet each class once at start-up instead."""

from __future__ import annotations

import itertools

import torch

from language.model_runner import ModelRunner
from language.request import MultimodalItem, Request
from language.sampling_params import SamplingParams


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


@torch.inference_mode()
def warmup(runner: ModelRunner, model: torch.nn.Module, hidden: int) -> None:
    kv = runner.kv
    params = SamplingParams(max_new_tokens=1)
    for i, lens in enumerate(warmup_shapes()):
        reqs = [Request(f"warmup-{i}-{j}", [0] * n, params) for j, n in enumerate(lens)]
        if i < 2:  # the image splice kernel too, with both kinds of embedding count
            n = reqs[0].prompt_len
            embeds = torch.zeros(n, hidden, dtype=model.embed_tokens.weight.dtype)
            reqs[0].mm_items.append(MultimodalItem(offset=0, embeds=embeds))
        if sum(lens) > kv.slots.num_free or len(reqs) > kv.num_free_rows():
            continue
        for r in reqs:
            if not r.mm_items:  # image requests keep plain positions: their grids are made up
                model.prepare_request(r)
        runner.prefill(reqs)
        for r in reqs:
            kv.free_row(r.req_idx, r.prompt_len)
            r.req_idx = -1
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
