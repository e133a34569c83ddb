"""Top-p (and min-p) sampling without sorting the vocabulary: one program per row draws by rejection, as
`nucleus_draw_ref` defines it.

Sorting a row of 152k logits to find its nucleus costs about as much as the decode step it samples for (6-7 ms at
batch 256 on an H100). But whether an id is in the nucleus needs no order: it is iff the mass of the ids strictly
likelier than it is under top_p. So each round races over the ids above a floor (argmax of logit - log E, E ~ Exp(1)
from the seeded hash: a draw from the softmax), then one pass sums the mass above the winner. Inside: done. Outside:
so is every id at or below it, and the floor rises to it. A round accepts with probability at least top_p, and each
rejection leaves the mass above the floor about halved, so two passes over the row are the usual cost (one without
top-p) and the 32-round cap (then the most likely id) is out of reach in practice.

The first pass finds the row's largest logit and races round 0 at once (the floor starts at -inf); the mass that
min-p keeps, which top-p's share is of, is summed in each check."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import check_device, check_dtype, check_inner_contiguous, check_shape
from language.kernels.sampling_reference import NUCLEUS_MAX_ROUNDS

BLOCK = 4096  # columns a program reads at a time
_MASK32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _race_key(scaled, cols, seed_mix, step, round_):
    """scaled - log(E) with E = -log(u), u from seeded_uniform's hash of (seed, step, column, round)."""
    x = (seed_mix * 0x9E3779B1 + step * 0x85EBCA77 + cols.to(tl.int64) * 0xC2B2AE3D + round_ * 0x27D4EB2F) & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 16)) * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    u = ((x >> 9).to(tl.float32) + 0.5) / 8388608.0
    return scaled - tl.log(-tl.log(u))


@triton.jit
def _first_best(key, cols, best_key, best_col):
    """Lane-wise running argmax: a lane keeps its earlier column on a tie, as torch.argmax keeps the first."""
    take = key > best_key
    return tl.where(take, key, best_key), tl.where(take, cols, best_col)


@triton.jit
def _winner(best_key, best_col, vocab):
    """The smallest column among the lanes holding the largest key (kept inside the row should NaNs match none)."""
    top = tl.max(best_key, 0)
    return tl.minimum(tl.min(tl.where(best_key == top, best_col, vocab), 0), vocab - 1)


@triton.jit
def _nucleus_draw_kernel(
    logits_ptr,  # [R, V] fp32, rows strided
    temperature_ptr,  # [R] fp32
    top_p_ptr,  # [R] fp32
    log_min_p_ptr,  # [R] fp32 (-inf: no min-p)
    seed_ptr,  # [R] int64
    step_ptr,  # [R] int64
    out_ptr,  # [R] int64
    stride_row,
    vocab,
    BLOCK: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    seed_mix = (seed ^ (seed >> 32)) & _MASK32
    step = tl.load(step_ptr + row)
    offs = tl.arange(0, BLOCK)

    # Pass 1: the largest scaled logit (its first column: the fallback) and round 0's race over every id.
    top_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    top_col = tl.full([BLOCK], 0, tl.int32)
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], 0, tl.int32)
    for k0 in range(0, vocab, BLOCK):
        cols = k0 + offs
        scaled = tl.math.div_rn(tl.load(logits + cols, mask=cols < vocab, other=float("-inf")), temperature)
        top_lane, top_col = _first_best(scaled, cols, top_lane, top_col)
        key = tl.where(scaled > float("-inf"), _race_key(scaled, cols, seed_mix, step, 0), float("-inf"))
        best_key, best_col = _first_best(key, cols, best_key, best_col)
    top = tl.max(top_lane, 0)
    most_likely = _winner(top_lane, top_col, vocab)
    floor = top + tl.load(log_min_p_ptr + row)
    choice = _winner(best_key, best_col, vocab)

    done = 0
    round_ = 0
    while (done == 0) & (round_ < MAX_ROUNDS):
        at = tl.math.div_rn(tl.load(logits + choice), temperature)
        if top_p >= 1.0:
            done = (at >= floor).to(tl.int32)
        else:
            # The mass strictly above the winner, and the mass min-p keeps.
            above_lane = tl.zeros([BLOCK], tl.float32)
            kept_lane = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, vocab, BLOCK):
                cols = k0 + offs
                scaled = tl.math.div_rn(tl.load(logits + cols, mask=cols < vocab, other=float("-inf")), temperature)
                weight = tl.exp(scaled - top)
                above_lane += tl.where(scaled > at, weight, 0.0)
                kept_lane += tl.where(scaled >= floor, weight, 0.0)
            kept_mass = tl.sum(kept_lane, 0)  # the same sum each round: summing it again costs less than a branch
            above = tl.sum(above_lane, 0)  # 0 for the most likely ids, which are always inside (HF keeps the first)
            done = ((at >= floor) & ((above < top_p * kept_mass) | (above == 0.0))).to(tl.int32)
        round_ += 1
        if (done == 0) & (round_ < MAX_ROUNDS):  # race again over the ids above the winner
            best_key = tl.full([BLOCK], float("-inf"), tl.float32)
            best_col = tl.full([BLOCK], 0, tl.int32)
            for k0 in range(0, vocab, BLOCK):
                cols = k0 + offs
                scaled = tl.math.div_rn(tl.load(logits + cols, mask=cols < vocab, other=float("-inf")), temperature)
                key = tl.where(scaled > at, _race_key(scaled, cols, seed_mix, step, round_), float("-inf"))
                best_key, best_col = _first_best(key, cols, best_key, best_col)
            choice = _winner(best_key, best_col, vocab)
    if done == 0:
        choice = most_likely
    tl.store(out_ptr + row, choice.to(tl.int64))


def nucleus_draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `nucleus_draw_ref`: logits [R, V] fp32 (rows may be strided) with temperature, top_p,
    log_min_p [R] fp32 and seed, step [R] int64 -> [R] int64."""
    device = check_device(
        logits=logits, temperature=temperature, top_p=top_p, log_min_p=log_min_p, seed=seed, step=step
    )
    check_dtype("logits", logits, (torch.float32,))
    check_shape("logits", logits, (None, None))
    check_inner_contiguous("logits", logits)
    num_rows, vocab = logits.shape
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_p", top_p, torch.float32),
        ("log_min_p", log_min_p, torch.float32),
        ("seed", seed, torch.int64),
        ("step", step, torch.int64),
    ):
        check_shape(name, t, (num_rows,))
        check_dtype(name, t, (dtype,))
    assert vocab < 2**31, f"vocabulary of {vocab} ids: columns are int32"
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows:
        _nucleus_draw_kernel[(num_rows,)](
            logits, temperature.contiguous(), top_p.contiguous(), log_min_p.contiguous(), seed.contiguous(),
            step.contiguous(), out, logits.stride(0), vocab, BLOCK=BLOCK, MAX_ROUNDS=NUCLEUS_MAX_ROUNDS, num_warps=8,
        )  # fmt: skip
    return out
