"""The fidelity rule for quantized serving (issue 33): a quantized engine's greedy tokens can no longer equal the
bf16 reference's bit for bit, so at the first position where the two sequences differ, each side's token must be
among the other side's 5 most likely tokens there (both sides then saw the same prefix). Used by the CPU tests
(tests/models/test_fp8.py) and the GPU script (benchmarks/quant_fidelity.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

TOP_K = 5
_rids = itertools.count()


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first index where the sequences differ (None: equal over their common length)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)


def check_top_k_rule(
    ours: Sequence[int],
    theirs: Sequence[int],
    our_top: Callable[[int], Sequence[int]],
    their_top: Callable[[int], Sequence[int]],
    k: int = TOP_K,
) -> str | None:
    """None where the rule holds; else what broke it. `our_top(i)` / `their_top(i)`: each side's k most likely
    next tokens after the prompt and the first i generated tokens (asked only at a divergence)."""
    i = first_divergence(ours, theirs)
    if i is None:
        return None
    mine, yours = list(our_top(i))[:k], list(their_top(i))[:k]
    if ours[i] in yours and theirs[i] in mine:
        return None
    return (
        f"step {i}: ours {ours[i]} (their top-{k} {yours}), theirs {theirs[i]} (our top-{k} {mine}); "
        f"the first {i} tokens agreed"
    )


def engine_top_k(llm, prompt: Sequence[int], mm_items: list | None = None, k: int = TOP_K) -> list[int]:
    """An `mmserve.llm.LLM`'s k most likely next tokens after `prompt` (one step; multimodal items spliced in at
    their offsets as when generating)."""
    from language.request import Request
    from language.sampling_params import SamplingParams

    rid = f"top-k-{next(_rids)}"
    params = SamplingParams(max_new_tokens=1, top_logprobs=k).validate()
    req = Request(rid, list(prompt), params, mm_items=list(mm_items or []))
    llm.engine.add_request(req)
    tops = []
    while not req.finished:
        tops += [t for out in llm.engine.step() if out.rid == rid for t in (out.new_top_logprobs or [])]
    return [token for token, _ in tops[0]]
