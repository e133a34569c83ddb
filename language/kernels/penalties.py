"""Repetition, frequency and presence penalties in one pass over the logits: each program reads a block of a row's
logits and the same block of its request's table rows (output counts, prompt ids: language/penalties.py) and writes
the penalised logits, where the torch reference runs a dozen [B, V] operations with their temporaries.

Arithmetic as the reference's, on fp32: a seen id's logit divided by the repetition penalty if positive, multiplied
if not (HF's), then minus frequency x count, minus presence where the count is positive (OpenAI's)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_shape,
)

BLOCK = 4096  # columns per program: Qwen2-VL's 152064-wide vocabulary is 38 programs a row


@triton.jit
def _penalize_kernel(
    logits_ptr,  # [B, V] fp32, rows strided
    out_ptr,  # [B, V] fp32, contiguous
    table_row_ptr,  # [B] int64: each row's row of the tables
    counts_ptr,  # [T, V] fp32: output counts
    in_prompt_ptr,  # [T, V] uint8: 1 where the prompt holds the id
    repetition_ptr,  # [B] fp32
    frequency_ptr,  # [B] fp32
    presence_ptr,  # [B] fp32
    stride_logits,
    stride_table,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    table = tl.load(table_row_ptr + row)
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=valid, other=0.0)
    counts = tl.load(counts_ptr + table * stride_table + cols, mask=valid, other=0.0)
    in_prompt = tl.load(in_prompt_ptr + table * stride_table + cols, mask=valid, other=0)
    rep = tl.load(repetition_ptr + row)
    came_out = counts > 0
    penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    x = tl.where((in_prompt != 0) | came_out, penalised, x)
    x = x - tl.load(frequency_ptr + row) * counts
    x = x - tl.load(presence_ptr + row) * came_out.to(tl.float32)
    tl.store(out_ptr + row * vocab + cols, x, mask=valid)


def penalize(
    logits: torch.Tensor,
    table_rows: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] fp32 -> penalised [B, V] fp32 (a new tensor). table_rows [B] int64 into counts [T, V] fp32 and
    in_prompt [T, V] bool (both contiguous); repetition, frequency, presence [B] fp32."""
    device = check_device(logits=logits, table_rows=table_rows, counts=counts, in_prompt=in_prompt)
    num_rows, vocab = logits.shape
    check_dtype("logits", logits, (torch.float32,))
    check_inner_contiguous("logits", logits)
    check_shape("table_rows", table_rows, (num_rows,))
    check_dtype("table_rows", table_rows, (torch.int64,))
    check_shape("counts", counts, (None, vocab))
    check_dtype("counts", counts, (torch.float32,))
    check_shape("in_prompt", in_prompt, tuple(counts.shape))
    check_dtype("in_prompt", in_prompt, (torch.bool,))
    assert counts.is_contiguous() and in_prompt.is_contiguous(), "counts, in_prompt: must be contiguous"
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_shape(name, t, (num_rows,))
        check_dtype(name, t, (torch.float32,))
    out = torch.empty((num_rows, vocab), dtype=torch.float32, device=device)
    if num_rows:
        _penalize_kernel[(num_rows, cdiv(vocab, BLOCK))](
            logits, out, table_rows, counts, in_prompt.view(torch.uint8), repetition, frequency, presence,
            logits.stride(0), counts.stride(0), vocab, BLOCK=BLOCK, num_warps=8,
            enable_fp_fusion=False,  # x - f * c rounded twice, as torch: no fused multiply-add
        )  # fmt: skip
    return out
