"""Dynamic FP8 (e4m3) quantization of activations: each row's groups of `group` columns get their own scale, the
group's largest magnitude over 448 (e4m3's largest finite value), and the values multiplied by its reciprocal
(vLLM's arithmetic), rounded to e4m3.
group = K is per-token quantization (the per-channel FP8 GEMMs); group = 128 is the 1x128 activation blocks of
block-wise FP8 checkpoints.

One program per (row, group): a pass over the group for its maximum, a second to scale and store. Both read the
row from L2 on the second pass. The batch-1 FP8 GEMV (fp8_gemv.py) quantizes its row itself with the same functions
(`e4m3_scale`, `e4m3_inverse`, `quantize_e4m3`), and so do the kernels that produce the FP8 linears' inputs (the
norms of rms_norm.py, the gated activations of silu_mul.py: `QuantizedRows`), so that no launch re-reads what they
wrote."""

from __future__ import annotations

import enum
from typing import NamedTuple

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
    interpreting,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero group: its values quantize to 0 whatever the scale
_MAX_BLOCK = 4096  # a 3584-wide row in one step; rows of 18944 (Qwen2-VL-7B's down input) in five
_MEASURED_BLOCK = 1024  # columns per program of quantize_measured: 19 programs for a row of 18944


class QuantizedRows(NamedTuple):
    """Activations already quantized per token for an FP8 linear: q [M, K] e4m3 (contiguous) with scales [M, 1]
    fp32 (x ~= q * scale), standing for rows of `dtype`, which the linear's output takes."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class InputForm(enum.Enum):
    """The rows a linear layer takes from the kernel before it (`input_form(rows)`): in the model's dtype, quantized
    per token (`QuantizedRows`), or with each row's largest magnitude measured (`MeasuredRows`)."""

    PLAIN = "plain"
    QUANTIZED = "quantized"
    MEASURED = "measured"


class MeasuredRows(NamedTuple):
    """Activations with each row's largest magnitude measured by the kernel that wrote them: x [M, K] in the model's
    dtype and amax [M, P] fp32, the maxima of |x| over P column blocks (a row's is their maximum). A decode row too
    wide for one program of its producer to quantize (down's input) comes so; `quantize_measured` then quantizes it
    in many programs at once, none of which has to find the row's maximum first."""

    x: torch.Tensor
    amax: torch.Tensor


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8e4nv, contiguous
    s_ptr,  # [M, G] fp32, contiguous
    K,
    G,
    stride_x,
    GROUP: tl.constexpr,  # columns per scale
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see quantize_e4m3
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    start = g * GROUP
    stop = tl.minimum(start + GROUP, K)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(start, stop, BLOCK):
        mask = k0 + offs < stop
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = e4m3_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row * G + g, scale)
    inv_scale = e4m3_inverse(scale)
    q_row = q_ptr + row.to(tl.int64) * K
    for k0 in range(start, stop, BLOCK):
        mask = k0 + offs < stop
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + offs, quantize_e4m3(x, inv_scale, FP8_MAX, ROUND_FP8), mask=mask)


@triton.jit
def e4m3_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """The scale of a group whose largest magnitude is amax (fp32): IEEE division, as the reference."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def e4m3_inverse(scale):
    """1 / scale (fp32, IEEE division, as the reference's): what quantize_e4m3 multiplies by."""
    return tl.math.div_rn(1.0, scale)


@triton.jit
def quantize_e4m3(x, inv_scale, FP8_MAX: tl.constexpr, ROUND_FP8: tl.constexpr):
    """x (fp32) times its group's inverse scale, clamped to e4m3's range and rounded to e4m3 (float8e4nv), ties to
    even. One multiply, not a division per value: an IEEE division on each column's way to the FP8 GEMV's products
    cost 3-6 us a linear at batch 1. Compiled, the cast is the hardware's rounding; ROUND_FP8 (the interpreter, whose
    own cast drops the carry into the exponent) rounds in fp32 arithmetic first, to the same values."""
    q = tl.clamp(x * inv_scale, -FP8_MAX, FP8_MAX)
    if ROUND_FP8:
        q = _round_to_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def store_quantized_row(
    v, q_row_ptr, s_ptr, offs, mask, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_FP8: tl.constexpr
):
    """Quantize one whole row held in registers (v fp32, 0 where masked off) as _quantize_kernel does with one group:
    its scale to s_ptr, its e4m3 values to q_row_ptr + offs."""
    scale = e4m3_scale(tl.max(tl.abs(v), 0), FP8_MAX, MIN_SCALE)
    tl.store(s_ptr, scale)
    tl.store(q_row_ptr + offs, quantize_e4m3(v, e4m3_inverse(scale), FP8_MAX, ROUND_FP8), mask=mask)


def empty_quantized_rows(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> QuantizedRows:
    """The outputs a producer kernel quantizes into: [rows, k] e4m3 and [rows, 1] fp32 scales."""
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=device)
    return QuantizedRows(q, torch.empty((rows, 1), dtype=torch.float32, device=device), dtype)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: what the
    hardware's float-to-e4m3 conversion does, so the cast after it is exact (and so is Triton's interpreter's, whose
    own rounding drops the carry into the exponent). e4m3 keeps 3 mantissa bits above 2^-6 and steps of 2^-9
    below it: the step at v is 2^(max(exponent(v), -6) - 3); adding and taking away 1.5 * 2^23 rounds v / step to an
    integer, ties to even (exact: |v / step| < 2^5, and scaling by a power of two is exact)."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, -6) - 3
    inv_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)
    step = ((127 + step_exponent) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    return ((v * inv_step + magic) - magic) * step


def quantize_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float) -> (q [M, K] e4m3 contiguous, scales [M, ceil(K / group)] fp32): x ~= q * scale per group.
    group None: one group per row (per-token)."""
    device = check_device(x=x)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    check_inner_contiguous("x", x)
    m, k = x.shape
    group = group or k
    assert group >= 1 and k >= 1, "empty rows or groups"
    groups = cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=device)
    if m == 0:
        return q, scales
    # Few rows are few programs (one per row and group), each looping over its row twice: wide steps keep a decode
    # batch's quantization to a few passes (1024-column steps took 10 us for 64 rows of 18944 on an H100).
    block = min(_MAX_BLOCK, pow2_at_least(min(group, k), 16))
    _quantize_kernel[(m, groups)](
        x, q, scales, k, groups, x.stride(0),
        GROUP=group, BLOCK=block, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ROUND_FP8=interpreting(),
        num_warps=4 if block <= 1024 else 8,
        **pdl_launch(device),
    )  # fmt: skip
    return q, scales


@triton.jit
def _quantize_measured_kernel(
    x_ptr,  # [M, K]
    amax_ptr,  # [M, P] fp32: the maxima of |x| over P column blocks
    q_ptr,  # [M, K] float8e4nv, contiguous
    s_ptr,  # [M, 1] fp32
    K,
    P,
    stride_x,
    stride_amax,
    BLOCK: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,  # >= P, a power of two
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see quantize_e4m3
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    parts = tl.arange(0, PARTS_BLOCK)
    amax = tl.load(amax_ptr + row * stride_amax + parts, mask=parts < P, other=0.0)
    scale = e4m3_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
    if block == 0:
        tl.store(s_ptr + row, scale)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q = quantize_e4m3(x, e4m3_inverse(scale), FP8_MAX, ROUND_FP8)
    tl.store(q_ptr + row.to(tl.int64) * K + offs, q, mask=mask)


def quantize_measured(rows: MeasuredRows) -> QuantizedRows:
    """Rows whose producer measured their largest magnitudes, quantized per token: quantize_fp8's e4m3 values and
    scales, bit for bit, by programs that each take 1024 columns of a row, since none has to find the row's
    maximum first (quantize_fp8's one program per row reads a row of 18944 twice)."""
    x, amax = rows
    device = check_device(x=x, amax=amax)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("amax", amax, (torch.float32,))
    check_shape("x", x, (None, None))
    check_shape("amax", amax, (x.shape[0], None))
    check_inner_contiguous("x", x)
    check_inner_contiguous("amax", amax)
    m, k = x.shape
    out = empty_quantized_rows(m, k, x.dtype, device)
    if m == 0 or k == 0:
        return out
    _quantize_measured_kernel[(m, cdiv(k, _MEASURED_BLOCK))](
        x, amax, out.q, out.scale, k, amax.shape[1], x.stride(0), amax.stride(0),
        BLOCK=_MEASURED_BLOCK, PARTS_BLOCK=pow2_at_least(amax.shape[1], 16), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        ROUND_FP8=interpreting(), num_warps=4, **pdl_launch(device),
    )  # fmt: skip
    return out
