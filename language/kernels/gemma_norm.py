"""Gemma's RMSNorm, one program per row, with HF Gemma3RMSNorm's arithmetic: normalise and scale by (1 + weight) all
in fp32 (the weight read as fp32, the offset added there), then one rounding to x's dtype. Llama's norm rounds before
the scale instead (rms_norm.py), which would move Gemma's greedy tokens off HF's.

Gemma normalises a sublayer's output *before* the residual add, then the next sublayer's input: `norm_add_norm`
does both norms and the add between them in one launch: the post-attention norm, add, pre-feedforward norm inside a
layer, and the post-feedforward norm, add, next layer's input norm (or the final norm) across layers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    pdl_enter,
    pdl_launch,
)
from language.kernels.rms_norm import row_launch_shape


@triton.jit
def _gemma_normed(x, weight_ptr, offs, mask, hidden, eps):
    """x: one fp32 row -> x * rsqrt(mean(x^2) + eps) * (1 + weight), fp32, not yet rounded."""
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * inv_rms * (1.0 + weight)


@triton.jit
def _gemma_rms_norm_kernel(
    x_ptr,  # [N, H]
    weight_ptr,  # [H]
    out_ptr,  # [N, H]
    stride_x,
    stride_out,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _gemma_normed(x, weight_ptr, offs, mask, hidden, eps)
    tl.store(out_ptr + row * stride_out + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemma_norm_add_norm_kernel(
    x_ptr,  # [N, H] a sublayer's output
    residual_ptr,  # [N, H]
    x_weight_ptr,  # [H] the norm of x
    weight_ptr,  # [H] the norm of the sum
    out_ptr,  # [N, H] normed sum
    sum_ptr,  # [N, H] residual + norm(x), the next residual
    stride_x,
    stride_res,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    # Each rounding where HF's torch rounds: the norm's output, then the sum (`residual + norm(x)` in x's dtype).
    x_normed = _gemma_normed(x, x_weight_ptr, offs, mask, hidden, eps).to(sum_ptr.dtype.element_ty).to(tl.float32)
    summed = (res + x_normed).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + offs, summed, mask=mask)
    normed = _gemma_normed(summed.to(tl.float32), weight_ptr, offs, mask, hidden, eps)
    tl.store(out_ptr + row * hidden + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [N, H], weight: [H] (any float dtype) -> [N, H] in x's dtype, as HF's Gemma3RMSNorm (`type_as(x)`)."""
    device = check_device(x=x, weight=weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    num_rows, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    check_inner_contiguous("x", x)
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    check_out(out, (num_rows, hidden), x.dtype, device)
    if num_rows == 0:
        return out
    block_h, num_warps = row_launch_shape(hidden)
    _gemma_rms_norm_kernel[(num_rows,)](
        x, weight.contiguous(), out, x.stride(0), out.stride(0), hidden, eps, BLOCK_H=block_h, num_warps=num_warps,
        **pdl_launch(device),
    )  # fmt: skip
    return out


def gemma_norm_add_norm(
    x: torch.Tensor, residual: torch.Tensor, x_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, H] (same dtype), x_weight, weight: [H] -> (gemma_rms_norm(summed, weight), summed) where
    summed = residual + gemma_rms_norm(x, x_weight): a Gemma sublayer's post-norm and residual add, then the next
    sublayer's pre-norm. Both outputs new and contiguous, in x's dtype."""
    device = check_device(x=x, residual=residual, x_weight=x_weight, weight=weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("x_weight", x_weight, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    num_rows, hidden = x.shape
    check_shape("residual", residual, (num_rows, hidden))
    check_shape("x_weight", x_weight, (hidden,))
    check_shape("weight", weight, (hidden,))
    assert residual.dtype == x.dtype, f"residual: dtype {residual.dtype}, expected {x.dtype}"
    check_inner_contiguous("x", x)
    check_inner_contiguous("residual", residual)
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    summed = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    if num_rows == 0:
        return out, summed
    block_h, num_warps = row_launch_shape(hidden)
    _gemma_norm_add_norm_kernel[(num_rows,)](
        x, residual, x_weight.contiguous(), weight.contiguous(), out, summed, x.stride(0), residual.stride(0), hidden,
        eps, BLOCK_H=block_h, num_warps=num_warps, **pdl_launch(device),
    )  # fmt: skip
    return out, summed
