"""RMSNorm, one program per row, with HF Llama's rounding (normalise in fp32, cast to x's dtype, then scale)."""

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
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # Round to x's dtype before the weight multiply, exactly as the reference (and HF) does.
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


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
    block_h = pow2_at_least(hidden, 16)
    num_warps = min(max(block_h // 512, 1), 16)
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, x.stride(0), out.stride(0), hidden, eps, BLOCK_H=block_h, num_warps=num_warps
    )
    return out
