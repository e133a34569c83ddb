"""One FP8 row times an FP8 weight matrix, with scales: the linear layers of a batch-1 decode step under FP8
quantization, which only stream their weights (half the bf16 GEMV's bytes).

out[n] = sum over k of x[k] * w[n, k] * x_scale[g(k)] * w_scale[n, g(k)], g(k) = k // group: one activation scale
per group of the row and one weight scale per (output row, group). Per-channel weights (and per-token activations)
are the case of one group per row, passed with group-stride 0. As the bf16 GEMV (language/kernels/gemv.py), each
program owns BLOCK_N output features and walks the whole reduction with a [BLOCK_N, BLOCK_K] fp32 accumulator."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.fp8_quant import FP8_DTYPE
from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    pow2_at_least,
)

_BLOCK_N = 8  # fp8 rows are half as long in bytes as bf16's: twice the rows per program for the same bytes in flight
_MAX_BLOCK_K = 512


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K] e4m3
    xs_ptr,  # [G] fp32
    w_ptr,  # [N, K] e4m3, rows contiguous
    ws_ptr,  # [N, G] fp32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    stride_ws_n,
    stride_g,  # 1 with groups, 0 per channel (every step reads the row's one scale)
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,  # columns per scale; a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        g = (k0 // GROUP) * stride_g
        scale = tl.load(ws_ptr + offs_n * stride_ws_n + g, mask=n_mask, other=0.0) * tl.load(xs_ptr + g)
        acc += (w * x[None, :]) * scale[:, None]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)  # [BLOCK_N] fp32
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def fp8_gemv(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_q [1, K] e4m3 with x_scale [1, G], weight [N, K] e4m3 with weight_scale [N, G] (fp32; G = 1: per channel,
    else groups of ceil(K / G) rounded up to a power of two, 128 for published checkpoints) (+ bias [N]) ->
    [1, N] in out_dtype."""
    device, num_out, k = check_fp8_linear_operands(x_q, x_scale, weight, weight_scale, bias, rows=1)
    groups = weight_scale.shape[1]
    if out is None:
        out = torch.empty((1, num_out), dtype=out_dtype, device=device)
    check_out(out, (1, num_out), out_dtype, device)
    assert k >= 1, "weight: empty reduction dimension"
    if num_out == 0:
        return out
    if groups == 1:
        block_k = min(_MAX_BLOCK_K, pow2_at_least(k, 16))
        group, stride_g = block_k, 0
    else:
        group = group_size(k, groups)
        block_k, stride_g = min(group, _MAX_BLOCK_K), 1
    _fp8_gemv_kernel[(cdiv(num_out, _BLOCK_N),)](
        x_q, x_scale, weight, weight_scale, weight_scale if bias is None else bias, out, num_out, k,
        weight.stride(0), weight_scale.stride(0), stride_g,
        HAS_BIAS=bias is not None, GROUP=group, BLOCK_N=_BLOCK_N, BLOCK_K=block_k,
        num_warps=8 if k >= 8192 else 4, num_stages=1,
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
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_shape("x_q", x_q, (rows, None))
    num_out, k = weight.shape[0], x_q.shape[1]
    check_shape("weight", weight, (None, k))
    groups = weight_scale.shape[1]
    check_shape("weight_scale", weight_scale, (num_out, None))
    check_shape("x_scale", x_scale, (x_q.shape[0], groups))
    check_dtype("x_scale", x_scale, (torch.float32,))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    for name, t in (("x_q", x_q), ("weight", weight), ("x_scale", x_scale), ("weight_scale", weight_scale)):
        check_inner_contiguous(name, t)
    if bias is not None:
        check_shape("bias", bias, (num_out,))
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_inner_contiguous("bias", bias)
    return device, num_out, k
