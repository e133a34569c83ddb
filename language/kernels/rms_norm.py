"""RMSNorm, one program per row, with HF Llama's rounding (normalise in fp32, cast to x's dtype, then scale); and the
residual add fused in front of it, which saves a decode step two launches per layer.

The `_fp8` launchers write the normalised rows quantized for an FP8 linear instead (`QuantizedRows`): each row is in
registers whole, so its scale and e4m3 values come from the rounded output with quantize_fp8's arithmetic, bit for
bit what the norm then the quantizer give, without writing the rows in bf16 and reading them back. The `_measured`
launchers write the rows as the plain ones do, with each row's largest magnitude (`MeasuredRows`), for an FP8 linear
that quantizes them with quantize_measured."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.fp8_quant import (
    FP8_MAX,
    MIN_SCALE,
    MeasuredRows,
    QuantizedRows,
    empty_quantized_rows,
    store_quantized_row,
)
from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    interpreting,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H]
    weight_ptr,  # [H]
    out_ptr,  # [N, H]: in the output dtype, or e4m3 (QUANTIZE)
    scale_ptr,  # [N] fp32: the scales (QUANTIZE), the rows' largest magnitudes (MEASURE); else unused
    stride_x,
    stride_out,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    QUANTIZE: tl.constexpr,
    MEASURE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see fp8_quant.quantize_e4m3
    USE_PDL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    # No step writes the weight: it is requested before the wait for the kernel before (under PDL, while it drains).
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # Round to x's dtype before the weight multiply, exactly as the reference (and HF) does.
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_normed(
        weight * normed, out_ptr + row * stride_out, scale_ptr + row, offs, mask, x_ptr.dtype.element_ty,
        QUANTIZE, MEASURE, FP8_MAX, MIN_SCALE, ROUND_FP8,
    )  # fmt: skip


@triton.jit
def _store_normed(
    y, out_row_ptr, scale_ptr, offs, mask, ROUND_TO: tl.constexpr, QUANTIZE: tl.constexpr, MEASURE: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_FP8: tl.constexpr,
):  # fmt: skip
    """A normalised row y (fp32) to its output: rounded to the output dtype, or quantized from that rounding (the
    values the unquantized launch would write, ROUND_TO: the output dtype); MEASURE: rounded, and its largest
    magnitude to scale_ptr."""
    if QUANTIZE:
        rounded = y.to(ROUND_TO).to(tl.float32)
        store_quantized_row(rounded, out_row_ptr, scale_ptr, offs, mask, FP8_MAX, MIN_SCALE, ROUND_FP8)
    else:
        rounded = y.to(out_row_ptr.dtype.element_ty)
        tl.store(out_row_ptr + offs, rounded, mask=mask)
        if MEASURE:  # masked columns hold 0 (the weight loads 0 there)
            tl.store(scale_ptr, tl.max(tl.abs(rounded.to(tl.float32)), 0))


def row_launch_shape(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a kernel with one program per row of `hidden` values: the whole row in one block,
    a warp per 512 values (at most 16)."""
    block_h = pow2_at_least(hidden, 16)
    return block_h, min(max(block_h // 512, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H], weight: [H] -> [N, H] in the promoted dtype of (weight, x), like the reference."""
    device = _check_norm_operands(x, weight)
    num_rows, hidden = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=out_dtype, device=device)
    check_out(out, (num_rows, hidden), out_dtype, device)
    _launch_rms_norm(x, weight.contiguous(), eps, out, out, quantize=False)
    return out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
    """rms_norm(x, weight, eps) quantized per row for an FP8 linear; weight in x's dtype (the output's)."""
    device = _check_norm_operands(x, weight, quantized=True)
    rows = empty_quantized_rows(x.shape[0], x.shape[1], x.dtype, device)
    _launch_rms_norm(x, weight.contiguous(), eps, rows.q, rows.scale, quantize=True)
    return rows


def rms_norm_measured(x: torch.Tensor, weight: torch.Tensor, eps: float) -> MeasuredRows:
    """rms_norm(x, weight, eps) (weight in x's dtype) with each row's largest magnitude, for an FP8 GEMV."""
    _check_norm_operands(x, weight, quantized=True)
    rows = _empty_measured_rows(x)
    _launch_rms_norm(x, weight.contiguous(), eps, rows.x, rows.amax, quantize=False, measure=True)
    return rows


def _empty_measured_rows(x: torch.Tensor) -> MeasuredRows:
    rows = x.shape[0]
    amax = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    return MeasuredRows(torch.empty(x.shape, dtype=x.dtype, device=x.device), amax)


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    scales: torch.Tensor,
    *,
    quantize: bool,
    measure: bool = False,
) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block_h, num_warps = row_launch_shape(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, scales, x.stride(0), out.stride(0), hidden, eps, BLOCK_H=block_h, QUANTIZE=quantize,
        MEASURE=measure, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ROUND_FP8=interpreting(), num_warps=num_warps,
        **pdl_launch(x.device),
    )  # fmt: skip


def _check_norm_operands(x: torch.Tensor, weight: torch.Tensor, *, quantized: bool = False) -> torch.device:
    """x [N, H] read as contiguous rows, weight [H]; a quantized output rounds to x's dtype first, so the weight
    must not promote it."""
    device = check_device(x=x, weight=weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (x.dtype,) if quantized else FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    check_shape("weight", weight, (x.shape[1],))
    check_inner_contiguous("x", x)
    return device


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H]
    weight_ptr,  # [H]
    out_ptr,  # [N, H] normed: in the output dtype, or e4m3 (QUANTIZE)
    scale_ptr,  # [N] fp32: the scales (QUANTIZE), the rows' largest magnitudes (MEASURE); else unused
    sum_ptr,  # [N, H] x + residual, the next residual
    stride_x,
    stride_res,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    QUANTIZE: tl.constexpr,
    MEASURE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see fp8_quant.quantize_e4m3
    USE_PDL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    # No step writes the weight: it is requested before the wait for the kernel before (under PDL, while it drains).
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded to the activations' dtype first, as `residual + x` in torch (and HF) is.
    summed = (x + res).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + offs, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    normed = (s * inv_rms).to(sum_ptr.dtype.element_ty).to(tl.float32)
    _store_normed(
        weight * normed, out_ptr + row * hidden, scale_ptr + row, offs, mask, sum_ptr.dtype.element_ty,
        QUANTIZE, MEASURE, FP8_MAX, MIN_SCALE, ROUND_FP8,
    )  # fmt: skip


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, H] (same dtype), weight: [H] -> (rms_norm(residual + x) in the promoted dtype of (weight, x),
    residual + x): the pre-norm of a decoder sublayer and the residual stream it carries on."""
    device = _check_add_norm_operands(x, residual, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=device)
    _launch_add_rms_norm(x, residual, weight.contiguous(), eps, out, out, summed, quantize=False)
    return out, summed


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[QuantizedRows, torch.Tensor]:
    """add_rms_norm with the normalised rows quantized per row for an FP8 linear (weight in x's dtype)."""
    device = _check_add_norm_operands(x, residual, weight, quantized=True)
    rows = empty_quantized_rows(x.shape[0], x.shape[1], x.dtype, device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=device)
    _launch_add_rms_norm(x, residual, weight.contiguous(), eps, rows.q, rows.scale, summed, quantize=True)
    return rows, summed


def add_rms_norm_measured(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[MeasuredRows, torch.Tensor]:
    """add_rms_norm (weight in x's dtype) with each normalised row's largest magnitude, for an FP8 GEMV."""
    device = _check_add_norm_operands(x, residual, weight, quantized=True)
    rows = _empty_measured_rows(x)
    summed = torch.empty(x.shape, dtype=x.dtype, device=device)
    _launch_add_rms_norm(x, residual, weight.contiguous(), eps, rows.x, rows.amax, summed, quantize=False, measure=True)
    return rows, summed


def _check_add_norm_operands(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, quantized: bool = False
) -> torch.device:
    device = _check_norm_operands(x, weight, quantized=quantized)
    check_device(x=x, residual=residual)
    check_shape("residual", residual, tuple(x.shape))
    assert residual.dtype == x.dtype, f"residual: dtype {residual.dtype}, expected {x.dtype}"
    check_inner_contiguous("residual", residual)
    return device


def _launch_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    scales: torch.Tensor,
    summed: torch.Tensor,
    *,
    quantize: bool,
    measure: bool = False,
) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block_h, num_warps = row_launch_shape(hidden)
    _add_rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, scales, summed, x.stride(0), residual.stride(0), hidden, eps,
        BLOCK_H=block_h, QUANTIZE=quantize, MEASURE=measure, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        ROUND_FP8=interpreting(), num_warps=num_warps, **pdl_launch(x.device),
    )  # fmt: skip
