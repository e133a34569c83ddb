"""Greedy sampling in two small launches: each row's argmax and its log-probability, max - logsumexp(row), read
once from the LM head's logits in their own dtype (no fp32 copy of the [B, V] table).

A row is split into chunks of CHUNK columns, one program each, so that a batch of one still spreads over many SMs
(Qwen2-VL's 152064-wide vocabulary: 149 programs of 1024 columns). Each program writes its chunk's maximum, the first
column holding it and sum(exp(x - max)); a second launch, one program per row, combines a row's chunks in their
fixed order (each reduction is a fixed tree over a fixed block): the same logits give the same bits on every replay.

Matches torch on the fp32 upcast (exact for bf16/fp16): the id is the FIRST index among equal maxima, as
torch.argmax's; log-probability = max - (max + log(sum)), as log_softmax gathered. Rows of -inf give id 0 and NaN
(-inf - -inf), as torch; a row holding NaN gives its first NaN's index (torch.argmax takes NaN as the maximum) and
a NaN log-probability."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_shape,
    multiprocessor_count,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)
from language.kernels.precompile import compiling_only

MIN_CHUNK = 1024
MAX_CHUNK = 8192  # 32 fp32 values a thread at 8 warps: a chunk is one load, no loop
_PROGRAMS_PER_SM = 2  # chunks shrink (to MIN_CHUNK) until the first launch has this many programs per SM
_NO_INDEX = 2**31 - 1  # above any column: loses every min()


@triton.jit
def _chunk_max_kernel(
    logits_ptr,  # [B, V], rows strided
    chunk_max_ptr,  # [B, C] fp32: the chunk's maximum; NaN where the chunk holds a NaN
    chunk_idx_ptr,  # [B, C] int32: the first column holding it (the first NaN's, where NaN)
    chunk_sum_ptr,  # [B, C] fp32: sum(exp(x - max)) over the chunk
    stride_row,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    NO_INDEX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    # Ties: the smallest column (tie_break_left). A chunk of -inf: top is -inf and its first valid column wins (the
    # padding columns, also -inf, come after every valid one).
    top, local = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    first = chunk * CHUNK + local
    shift = tl.where(top == float("-inf"), 0.0, top)  # exp(-inf - 0) = 0, not exp(NaN)
    total = tl.sum(tl.exp(x - shift), 0)
    first_nan = tl.min(tl.where(x != x, cols, NO_INDEX), 0)
    has_nan = first_nan != NO_INDEX
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, tl.where(has_nan, float("nan"), top))
    tl.store(chunk_idx_ptr + out, tl.where(has_nan, first_nan, first))
    tl.store(chunk_sum_ptr + out, total)


@triton.jit
def _combine_kernel(
    chunk_max_ptr,
    chunk_idx_ptr,
    chunk_sum_ptr,
    ids_ptr,  # [B] int64
    logprobs_ptr,  # [B] fp32
    num_chunks,
    BLOCK_C: tl.constexpr,
    NO_INDEX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    valid = offs < num_chunks
    base = row * num_chunks
    chunk_max = tl.load(chunk_max_ptr + base + offs, mask=valid, other=float("-inf"))
    chunk_idx = tl.load(chunk_idx_ptr + base + offs, mask=valid, other=NO_INDEX)
    chunk_sum = tl.load(chunk_sum_ptr + base + offs, mask=valid, other=0.0)
    is_nan = chunk_max != chunk_max
    clean_max = tl.where(is_nan, float("-inf"), chunk_max)
    # Chunks hold increasing columns, so the first chunk at the maximum holds the row's first column at it.
    top, at = tl.max(clean_max, 0, return_indices=True, return_indices_tie_break_left=True)
    first = tl.load(chunk_idx_ptr + base + at)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(valid, chunk_sum * tl.exp(clean_max - shift), 0.0), 0)
    logprob = top - (top + tl.log(total))  # as torch: chosen - logsumexp (an all -inf row: -inf - -inf = NaN)
    first_nan = tl.min(tl.where(is_nan, chunk_idx, NO_INDEX), 0)
    has_nan = first_nan != NO_INDEX
    tl.store(ids_ptr + row, tl.where(has_nan, first_nan, first).to(tl.int64))
    tl.store(logprobs_ptr + row, tl.where(has_nan, float("nan"), logprob))


def chunk_size(num_rows: int, vocab: int, device: torch.device) -> int:
    """Columns per program: the largest power of two in [MIN_CHUNK, MAX_CHUNK] that still gives the first launch
    _PROGRAMS_PER_SM programs per SM (a batch of one: MIN_CHUNK; of 64 at 152064 columns: MAX_CHUNK)."""
    wanted = _PROGRAMS_PER_SM * multiprocessor_count(device)
    chunk = MAX_CHUNK
    while chunk > MIN_CHUNK and num_rows * cdiv(vocab, chunk) < wanted:
        chunk //= 2
    return chunk


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32, fp16 or bf16; rows may be strided) -> (argmax ids [B] int64, their log-probabilities
    [B] fp32). No host sync: capturable in a CUDA graph."""
    device = check_device(logits=logits)
    check_dtype("logits", logits, FLOAT_DTYPES)
    check_shape("logits", logits, (None, None))
    check_inner_contiguous("logits", logits)
    num_rows, vocab = logits.shape
    assert vocab >= 1, "logits: empty vocabulary"
    assert vocab < _NO_INDEX, f"logits: vocabulary {vocab} too wide for int32 columns"
    ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return ids, logprobs
    chunk = chunk_size(num_rows, vocab, device)
    num_chunks = cdiv(vocab, chunk)
    chunk_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    chunk_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=device)
    chunk_sum = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    _chunk_max_kernel[(num_rows, num_chunks)](
        logits, chunk_max, chunk_idx, chunk_sum, logits.stride(0), vocab, num_chunks, CHUNK=chunk,
        NO_INDEX=_NO_INDEX, num_warps=4 if chunk <= 2048 else 8, **pdl_launch(device),
    )  # fmt: skip
    _combine_kernel[(num_rows,)](
        chunk_max, chunk_idx, chunk_sum, ids, logprobs, num_chunks, BLOCK_C=pow2_at_least(num_chunks, 16),
        NO_INDEX=_NO_INDEX, num_warps=1, **pdl_launch(device),
    )  # fmt: skip
    if compiling_only():  # nothing ran, and the engine's next step looks these ids up in its embedding table
        ids.zero_()
    return ids, logprobs
