"""The fidelity rule for quantized serving (issue 33): a quantized engine's greedy tokens can no longer equal the
bf16 reference's bit for bit, so at the first position where the two sequences differ, each side's token must be
among the other side's 5 most likely tokens there (both sides then saw the same prefix). Used by the CPU tests
(tests/models/test_fp8.py) and the GPU script (benchmarks/quant_fidelity.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

TOP_K = 5


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
