"""One FP8 row times an FP8 weight matrix, with scales: the linear layers of a batch-1 decode step under FP8
quantization, which only stream their weights (half the bf16 GEMV's bytes).

out[n] = sum over k of x[k] * w[n, k] * x_scale[g(k)] * w_scale[n, g(k)], g(k) = k // group: one activation scale
per group of the row and one weight scale per (output row, group). Per-channel weights (and per-token activations)
are the case of one group per row: their two scales multiply each row's sum once, after the reduction. As the bf16
GEMV (language/kernels/gemv.py), each program owns BLOCK_N output features and walks the whole reduction with a
[BLOCK_N, BLOCK_K] fp32 accumulator.

`fp8_gemv_fused` takes the float row itself and quantizes it inside the kernel, with quantize_fp8's functions: the
same e4m3 values and scales, so the same result bit for bit as quantize_fp8 then `fp8_gemv` launched alike, one
launch fewer."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from language.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, e4m3_inverse, e4m3_scale, quantize_e4m3
from language.kernels.gemv import load_weight_tile
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

_AMAX_BLOCK = 4096  # 32 values a thread at 4 warps
_MAX_BLOCK_K = 512  # and the largest column group a fused launch quantizes in one step
_NARROW_N = 4096  # output rows up to which a launch that quantizes its row takes 1024-column steps (o_proj's 3584)


class GemvConfig(NamedTuple):
    """A launch of the FP8 GEMV: output rows per program, columns per step (per-channel weights; grouped ones step
    one group at a time, up to _MAX_BLOCK_K columns), warps per program."""

    block_n: int
    block_k: int
    num_warps: int


def default_config(k: int, quantize_x: bool = True, n: int | None = None) -> GemvConfig:
    """The fastest of benchmarks/fp8_gemv_bench.py's grid on an H100 for the 7B shapes' linears: 8 x 1024 x 4 warps
    for K = 18944 (down); for K = 3584 8 x 512 x 4 for a row given quantized (qkv 8.4 against 8.7 us, gate_up 46.9
    against 48.4), and where the kernel quantizes the row 16 x 1024 x 8 for o's N = 3584 (7.1 against 8.9 us at
    16 x 512 x 4: half the steps for its 224 programs), else 16 x 512 x 4 (its work per column amortized over more
    weight rows). The LM head (N = 152064, K = 3584) takes gate_up's: a program's work depends on K alone (its
    BLOCK_N rows of K bytes, and the row's maximum), and gate_up's 2368 programs already fill the GPU many times
    over, as the head's 9504 do (the bench times the head's grid). n: the output rows (None: a wide layer's)."""
    if k >= 8192:
        return GemvConfig(8, 1024, 4)
    if quantize_x and n is not None and n <= _NARROW_N:
        return GemvConfig(16, 2 * _MAX_BLOCK_K, 8)
    return GemvConfig(16 if quantize_x else 8, min(_MAX_BLOCK_K, pow2_at_least(k, 16)), 4)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K]: e4m3 (scaled by xs_ptr), or float (QUANTIZE_X: quantized here, as quantize_fp8 does)
    xs_ptr,  # [G] fp32 (unused with QUANTIZE_X)
    w_ptr,  # [N, K] e4m3, rows contiguous
    ws_ptr,  # [N, G] fp32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    stride_ws_n,
    QUANTIZE_X: tl.constexpr,
    PER_CHANNEL: tl.constexpr,  # one scale per weight row and one for x: applied once, to each row's sum
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no column masks
    GROUP: tl.constexpr,  # columns per scale (grouped weights); a multiple of BLOCK_K, equal to it with QUANTIZE_X
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AMAX_BLOCK: tl.constexpr,  # columns per step of the row's maximum (QUANTIZE_X, PER_CHANNEL)
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # see fp8_quant.quantize_e4m3
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    # The first weight tile is requested before the wait for the previous kernel (no step writes weights): under
    # PDL its bytes stream in while that kernel drains (and, fused, while the row's maximum is read).
    w = load_weight_tile(w_ptrs, n_mask, offs_k, 0, K, EVEN_K)
    pdl_enter(USE_PDL)
    x_scale = 1.0  # grouped scales are read (or found) per step
    x_inv = 1.0
    if PER_CHANNEL:
        if QUANTIZE_X:  # every program reads the whole row for its maximum: a few KB from L2 (see fp8_gemv_fused)
            x_scale = e4m3_scale(_row_amax(x_ptr, K, AMAX_BLOCK), FP8_MAX, MIN_SCALE)
            x_inv = e4m3_inverse(x_scale)
        else:
            x_scale = tl.load(xs_ptr)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _accumulate(
        acc, w, x_ptr, xs_ptr, ws_ptr, offs_n, n_mask, offs_k, 0, K, stride_ws_n, x_scale, x_inv,
        QUANTIZE_X, PER_CHANNEL, EVEN_K, GROUP, FP8_MAX, MIN_SCALE, ROUND_FP8,
    )  # fmt: skip
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = load_weight_tile(w_ptrs + k0, n_mask, offs_k, k0, K, EVEN_K)
        acc = _accumulate(
            acc, w, x_ptr, xs_ptr, ws_ptr, offs_n, n_mask, offs_k, k0, K, stride_ws_n, x_scale, x_inv,
            QUANTIZE_X, PER_CHANNEL, EVEN_K, GROUP, FP8_MAX, MIN_SCALE, ROUND_FP8,
        )  # fmt: skip
    y = tl.sum(acc, 1)  # [BLOCK_N] fp32
    if PER_CHANNEL:
        y = y * (tl.load(ws_ptr + offs_n * stride_ws_n, mask=n_mask, other=0.0) * x_scale)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _accumulate(
    acc, w, x_ptr, xs_ptr, ws_ptr, offs_n, n_mask, offs_k, k0, K, stride_ws_n, x_scale, x_inv,
    QUANTIZE_X: tl.constexpr, PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_FP8: tl.constexpr,
):  # fmt: skip
    """acc + the products of weight tile w with x's columns k0:k0 + BLOCK_K (quantized here with QUANTIZE_X); per
    channel unscaled (x_scale and x_inv: the row's scale and its inverse, for QUANTIZE_X), grouped scaled by the
    step's group scales."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
    else:
        x = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
    if QUANTIZE_X:
        if not PER_CHANNEL:  # this step is one whole group
            x_scale = e4m3_scale(tl.max(tl.abs(x), 0), FP8_MAX, MIN_SCALE)
            x_inv = e4m3_inverse(x_scale)
        x = quantize_e4m3(x, x_inv, FP8_MAX, ROUND_FP8).to(tl.float32)  # the e4m3 values the unfused path loads
    if PER_CHANNEL:
        acc += w.to(tl.float32) * x[None, :]
    else:
        g = k0 // GROUP
        if not QUANTIZE_X:
            x_scale = tl.load(xs_ptr + g)
        scale = tl.load(ws_ptr + offs_n * stride_ws_n + g, mask=n_mask, other=0.0) * x_scale
        acc += (w.to(tl.float32) * x[None, :]) * scale[:, None]
    return acc


@triton.jit
def _row_amax(x_ptr, K, BLOCK: tl.constexpr):
    """The largest magnitude of x[0:K], in fp32 (a maximum: the same whatever the order, as quantize_fp8's). Wide
    steps: each is one round trip to L2 that the weight stream waits for."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    return tl.max(amax, 0)


def fp8_gemv(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x_q [1, K] e4m3 with x_scale [1, G], weight [N, K] e4m3 with weight_scale [N, G] (fp32; G = 1: per channel,
    else groups of ceil(K / G) rounded up to a power of two, 128 for published checkpoints) (+ bias [N]) ->
    [1, N] in out_dtype."""
    device, num_out, k = check_fp8_linear_operands(x_q, x_scale, weight, weight_scale, bias, rows=1)
    return _launch(x_q, x_scale, weight, weight_scale, bias, out, out_dtype, device, config, quantize_x=False)


def fp8_gemv_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """`fp8_gemv` of x [1, K] (float) quantized in the kernel, per token (G = 1) or per group of the weight's
    columns, with quantize_fp8's arithmetic: the same result as the two launches with the same GemvConfig, bit for
    bit, without the quantizer's. Out in out_dtype (default x's). Groups up to fused_groups_fit's size. o_proj's
    input takes it at batch 1; a row whose producer quantized it (QuantizedRows), or measured it (quantize_measured
    then), goes to fp8_gemv, which only streams weights: quantizing inside puts a multiply and a rounding per
    column on each program's way to its products (a 7B layer's down: 29.0 against 26.3 us on an H100).

    Per-channel weights need the whole row's maximum before any column is quantized; every program reads the row
    once for it (K * 2 bytes from L2: 7 KB for a 3584-wide row, against the BLOCK_N weight rows of K bytes each it
    streams from HBM), since a first pass would cost the launch this saves, and a grid-wide wait is not to be had."""
    device = check_device(x=x, weight=weight, weight_scale=weight_scale)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (1, None))
    check_inner_contiguous("x", x)
    num_out, k = check_fp8_weight(weight, weight_scale, bias, x.shape[1])
    assert fused_groups_fit(k, weight_scale.shape[1]), f"{weight_scale.shape[1]} groups over {k}: groups too wide"
    dtype = out_dtype or x.dtype
    return _launch(x, None, weight, weight_scale, bias, out, dtype, device, config, quantize_x=True)


def fused_groups_fit(k: int, groups: int) -> bool:
    """Whether fp8_gemv_fused takes a weight of `groups` column groups over k columns (per channel, or groups of at
    most _MAX_BLOCK_K columns: each step quantizes one)."""
    return groups == 1 or group_size(k, groups) <= _MAX_BLOCK_K


def _launch(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    device: torch.device,
    config: GemvConfig | None,
    *,
    quantize_x: bool,
) -> torch.Tensor:
    num_out, k = weight.shape
    if out is None:
        out = torch.empty((1, num_out), dtype=out_dtype, device=device)
    check_out(out, (1, num_out), out_dtype, device)
    assert k >= 1, "weight: empty reduction dimension"
    if num_out == 0:
        return out
    config = config or default_config(k, quantize_x, num_out)
    groups = weight_scale.shape[1]
    if groups == 1:
        block_k = min(config.block_k, pow2_at_least(k, 16))
        group = block_k  # unused
    else:
        group = group_size(k, groups)
        block_k = min(group, _MAX_BLOCK_K)
    _fp8_gemv_kernel[(cdiv(num_out, config.block_n),)](
        x, weight_scale if x_scale is None else x_scale, weight, weight_scale, weight_scale if bias is None else bias,
        out, num_out, k, weight.stride(0), weight_scale.stride(0),
        QUANTIZE_X=quantize_x, PER_CHANNEL=groups == 1, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        GROUP=group, BLOCK_N=config.block_n, BLOCK_K=block_k, AMAX_BLOCK=min(_AMAX_BLOCK, pow2_at_least(k, 16)),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ROUND_FP8=interpreting(),
        num_warps=config.num_warps, num_stages=1, **pdl_launch(device),
    )  # fmt: skip
    return out


def group_size(k: int, groups: int) -> int:
    """The columns per scale of a K-wide row cut into `groups` groups: a power of two (>= 16) with
    ceil(k / size) == groups. AssertionError where none is."""
    size = pow2_at_least(cdiv(k, groups), 16)
    assert cdiv(k, size) == groups, f"{groups} scale groups over {k} columns: not power-of-two groups"
    return size


def check_fp8_linear_operands(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    rows: int | None,
) -> tuple[torch.device, int, int]:
    """Checks fp8_gemv's and fp8_gemm's operands (x_q with `rows` rows, None: any); returns (device, N, K)."""
    device = check_device(x_q=x_q, x_scale=x_scale, weight=weight, weight_scale=weight_scale)
    check_dtype("x_q", x_q, (FP8_DTYPE,))
    check_shape("x_q", x_q, (rows, None))
    num_out, k = check_fp8_weight(weight, weight_scale, bias, x_q.shape[1])
    check_shape("x_scale", x_scale, (x_q.shape[0], weight_scale.shape[1]))
    check_dtype("x_scale", x_scale, (torch.float32,))
    check_inner_contiguous("x_q", x_q)
    check_inner_contiguous("x_scale", x_scale)
    return device, num_out, k


def check_fp8_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, k: int
) -> tuple[int, int]:
    """Checks an FP8 weight [N, k] with its scales [N, G] (+ bias [N]); returns (N, k)."""
    check_dtype("weight", weight, (FP8_DTYPE,))
    num_out = weight.shape[0]
    check_shape("weight", weight, (None, k))
    check_shape("weight_scale", weight_scale, (num_out, None))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    check_inner_contiguous("weight", weight)
    check_inner_contiguous("weight_scale", weight_scale)
    if bias is not None:
        check_shape("bias", bias, (num_out,))
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_inner_contiguous("bias", bias)
        assert bias.device == weight.device, "bias: on another device"
    return num_out, k
