"""FP8 GEMM with per-group scales on both operands: the linear layers of block-wise FP8 checkpoints (Qwen3-VL-FP8,
DeepSeek-V3's recipe): activations quantized per token per group of 128 columns, weights per 128x128 block.

out[m, n] = sum over k of x[m, k] * w[n, k] * x_scale[m, g(k)] * w_scale[n, g(k)], g(k) = k // group. The weight
scales are held per output row (a 128x128 block's scale repeated over its 128 rows, language/quant/fp8.py), so
fused and tensor-parallel slices of the weight rows need no block alignment. Each program owns a BLOCK_M x BLOCK_N
tile and walks K one group at a time: an FP8 tensor-core dot of the group, scaled by the outer product of the two
scale columns, added to an fp32 accumulator."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.fp8_gemv import check_fp8_linear_operands, group_size
from language.kernels.launch_utils import cdiv, check_out, pdl_enter, pdl_launch, pow2_at_least


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] e4m3, rows contiguous
    xs_ptr,  # [M, G] fp32
    w_ptr,  # [N, K] e4m3, rows contiguous
    ws_ptr,  # [N, G] fp32
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x,
    stride_xs,
    stride_w,
    stride_ws,
    stride_out,
    stride_g,  # 1 with groups, 0 per channel
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == the group size: one scale pair per step
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        g = (k0 // BLOCK_K) * stride_g
        xs = tl.load(xs_ptr + offs_m * stride_xs + g, mask=m_mask, other=0.0)
        ws = tl.load(ws_ptr + offs_n * stride_ws + g, mask=n_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w)) * (xs[:, None] * ws[None, :])
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with x_scale [M, G], weight [N, K] e4m3 with weight_scale [N, G] (fp32; G = 1: per token and
    per channel, else power-of-two groups of columns, 128 for published checkpoints) (+ bias [N]) -> [M, N] in
    out_dtype."""
    device, num_out, k = check_fp8_linear_operands(x_q, x_scale, weight, weight_scale, bias, rows=None)
    m, groups = x_q.shape[0], weight_scale.shape[1]
    if out is None:
        out = torch.empty((m, num_out), dtype=out_dtype, device=device)
    check_out(out, (m, num_out), out_dtype, device)
    assert k >= 1, "weight: empty reduction dimension"
    if m == 0 or num_out == 0:
        return out
    if groups == 1:
        block_k, stride_g = min(128, pow2_at_least(k, 16)), 0
    else:
        block_k, stride_g = group_size(k, groups), 1
        assert block_k <= 256, f"groups of {block_k} columns: at most 256 per step"
    block_m = min(64, pow2_at_least(m, 16))
    block_n = 128 if m > 16 else 64
    _fp8_gemm_kernel[(cdiv(m, block_m), cdiv(num_out, block_n))](
        x_q, x_scale, weight, weight_scale, weight_scale if bias is None else bias, out, m, num_out, k,
        x_q.stride(0), x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), stride_g,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
        **pdl_launch(device),
    )  # fmt: skip
    return out
