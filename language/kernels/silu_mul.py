"""The gated MLP's activation and multiply in one launch: [gate | up] -> act(gate) * up, with SiLU (Llama, Qwen) or
GELU's tanh approximation (Gemma: HF's gelu_pytorch_tanh, torch's gelu(approximate="tanh")).

The `_fp8` launchers write the product quantized per row for the FP8 down projection instead (`QuantizedRows`). A
row (18944 wide for Qwen2-VL-7B) spans several blocks and its scale needs its largest magnitude before any value is
scaled, so each row is one program that computes its product twice: a pass for the maximum, a pass to quantize and
store. The second pass re-reads [gate | up] (from L2), which costs less than writing the bf16 product and reading it
back twice, as the product then quantize_fp8 do. The `_measured` launchers write the product as the plain ones do,
with each 1024-column block's largest magnitude (`MeasuredRows`), for an FP8 linear of a decode batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.fp8_quant import (
    FP8_MAX,
    MIN_SCALE,
    MeasuredRows,
    QuantizedRows,
    e4m3_inverse,
    e4m3_scale,
    empty_quantized_rows,
    quantize_e4m3,
)
from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    cdiv,
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

_BLOCK = 1024
_MAX_QUANT_BLOCK = 4096  # columns per step of a quantizing program, as quantize_fp8's
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [N, 2I]
    out_ptr,  # [N, I]
    amax_ptr,  # [N, cdiv(I, BLOCK)] fp32: each block's largest magnitude (MEASURE; else unused)
    stride_x,
    stride_out,
    stride_amax,
    inter,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
    MEASURE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    product = _act_times_up(x_ptr + row * stride_x, offs, mask, inter, GELU_TANH).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, product, mask=mask)
    if MEASURE:  # masked columns hold 0 (their loads give 0)
        tl.store(amax_ptr + row * stride_amax + tl.program_id(1), tl.max(tl.abs(product.to(tl.float32)), 0))


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr,  # [N, 2I]
    q_ptr,  # [N, I] e4m3, contiguous
    scale_ptr,  # [N] fp32
    stride_x,
    inter,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see fp8_quant.quantize_e4m3
    USE_PDL: tl.constexpr,
):
    """One program per row: act(gate) * up rounded to x's dtype (what the unquantized kernel writes), its
    largest magnitude over the whole row, then the row again, quantized with that scale."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        mask = k0 + offs < inter
        product = _act_times_up(x_row, k0 + offs, mask, inter, GELU_TANH)
        amax = tl.maximum(amax, tl.abs(product.to(x_ptr.dtype.element_ty).to(tl.float32)))
    scale = e4m3_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    inv_scale = e4m3_inverse(scale)
    q_row = q_ptr + row * inter
    for k0 in range(0, inter, BLOCK):
        mask = k0 + offs < inter
        product = _act_times_up(x_row, k0 + offs, mask, inter, GELU_TANH).to(x_ptr.dtype.element_ty)
        q = quantize_e4m3(product.to(tl.float32), inv_scale, FP8_MAX, ROUND_FP8)
        tl.store(q_row + k0 + offs, q, mask=mask)


@triton.jit
def _act_times_up(x_row, offs, mask, inter, GELU_TANH: tl.constexpr):
    """act(gate) * up at columns offs of one [gate | up] row, in fp32 (0 where masked off), before its rounding to
    the output dtype."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 * g * (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) * (g + 0.044715 g^3): no tanh needed, and it
        # tends to 0 and g (never NaN) where exp over- or underflows.
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # The reference rounds act(gate) to the input dtype before the multiply; do the same.
    act = act.to(x_row.dtype.element_ty).to(tl.float32)
    return act * up


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> silu(gate) * up: [N, I], x's dtype."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> gelu(gate, approximate="tanh") * up: [N, I], x's dtype."""
    return _act_and_mul(x, out, gelu_tanh=True)


def silu_and_mul_fp8(x: torch.Tensor) -> QuantizedRows:
    """silu_and_mul(x) quantized per row for an FP8 linear."""
    return _act_and_mul_fp8(x, gelu_tanh=False)


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> QuantizedRows:
    """gelu_tanh_and_mul(x) quantized per row for an FP8 linear."""
    return _act_and_mul_fp8(x, gelu_tanh=True)


def _act_and_mul_fp8(x: torch.Tensor, gelu_tanh: bool) -> QuantizedRows:
    device = _check_gate_up(x)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    rows = empty_quantized_rows(num_rows, inter, x.dtype, device)
    if num_rows == 0 or inter == 0:
        return rows
    block = min(_MAX_QUANT_BLOCK, pow2_at_least(inter, 16))
    _act_and_mul_fp8_kernel[(num_rows,)](
        x, rows.q, rows.scale, x.stride(0), inter, BLOCK=block, GELU_TANH=gelu_tanh, FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE, ROUND_FP8=interpreting(), num_warps=4 if block <= 1024 else 8, **pdl_launch(device),
    )  # fmt: skip
    return rows


def _check_gate_up(x: torch.Tensor) -> torch.device:
    device = check_device(x=x)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    assert x.shape[1] % 2 == 0, f"x: last dimension {x.shape[1]} must be even ([gate | up])"
    check_inner_contiguous("x", x)
    return device


def silu_and_mul_measured(x: torch.Tensor) -> MeasuredRows:
    """silu_and_mul(x) with each row's largest magnitude (per 1024-column block), for an FP8 GEMV."""
    return _act_and_mul_measured(x, gelu_tanh=False)


def gelu_tanh_and_mul_measured(x: torch.Tensor) -> MeasuredRows:
    """gelu_tanh_and_mul(x) with each row's largest magnitude (per 1024-column block), for an FP8 GEMV."""
    return _act_and_mul_measured(x, gelu_tanh=True)


def _act_and_mul_measured(x: torch.Tensor, gelu_tanh: bool) -> MeasuredRows:
    num_rows, inter = x.shape[0], x.shape[1] // 2
    amax = torch.empty((num_rows, max(1, cdiv(inter, _BLOCK))), dtype=torch.float32, device=x.device)
    if inter == 0:
        amax.zero_()
    return MeasuredRows(_act_and_mul(x, None, gelu_tanh, amax), amax)


def _act_and_mul(
    x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool, amax: torch.Tensor | None = None
) -> torch.Tensor:
    device = _check_gate_up(x)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=x.dtype, device=device)
    check_out(out, (num_rows, inter), x.dtype, device)
    if num_rows == 0 or inter == 0:
        return out
    grid = (num_rows, cdiv(inter, _BLOCK))
    _act_and_mul_kernel[grid](
        x, out, out if amax is None else amax, x.stride(0), out.stride(0), 0 if amax is None else amax.stride(0),
        inter, BLOCK=_BLOCK, GELU_TANH=gelu_tanh, MEASURE=amax is not None, num_warps=4, **pdl_launch(device),
    )  # fmt: skip
    return out
