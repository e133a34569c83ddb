"""RMSNorm, one program per row, with HF Llama's rounding (normalise in fp32, cast to x's dtype, then scale); and the
residual add fused in front of it, which saves a decode step two launches per layer."""

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
    pow2_at_least,
)


@triton.jit
def _rms_norm_kernel(
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
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # Round to x's dtype before the weight multiply, exactly as the reference (and HF) does.
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def row_launch_shape(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a kernel with one program per row of `hidden` values: the whole row in one block,
    a warp per 512 values (at most 16)."""
    block_h = pow2_at_least(hidden, 16)
    return block_h, min(max(block_h // 512, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H], weight: [H] -> [N, H] in the promoted dtype of (weight, x), like the reference."""
    device = check_device(x=x, weight=weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    num_rows, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    check_inner_contiguous("x", x)
    weight = weight.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=out_dtype, device=device)
    check_out(out, (num_rows, hidden), out_dtype, device)
    if num_rows == 0:
        return out
    block_h, num_warps = row_launch_shape(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, x.stride(0), out.stride(0), hidden, eps, BLOCK_H=block_h, num_warps=num_warps,
        **pdl_launch(device),
    )  # fmt: skip
    return out


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H]
    weight_ptr,  # [H]
    out_ptr,  # [N, H] normed
    sum_ptr,  # [N, H] x + residual, the next residual
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
    # The sum is rounded to the activations' dtype first, as `residual + x` in torch (and HF) is.
    summed = (x + res).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + offs, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    normed = (s * inv_rms).to(sum_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, H] (same dtype), weight: [H] -> (rms_norm(residual + x) in the promoted dtype of (weight, x),
    residual + x): the pre-norm of a decoder sublayer and the residual stream it carries on."""
    device = check_device(x=x, residual=residual, weight=weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    num_rows, hidden = x.shape
    check_shape("residual", residual, (num_rows, hidden))
    check_shape("weight", weight, (hidden,))
    assert residual.dtype == x.dtype, f"residual: dtype {residual.dtype}, expected {x.dtype}"
    check_inner_contiguous("x", x)
    check_inner_contiguous("residual", residual)
    weight = weight.contiguous()
    out = torch.empty((num_rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    summed = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    if num_rows == 0:
        return out, summed
    block_h, num_warps = row_launch_shape(hidden)
    _add_rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, summed, x.stride(0), residual.stride(0), hidden, eps,
        BLOCK_H=block_h, num_warps=num_warps, **pdl_launch(device),
    )  # fmt: skip
    return out, summed
