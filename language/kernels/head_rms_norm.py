"""Qwen3's q/k norm: RMSNorm over each attention head of the queries and keys (weights [head_dim], one for the query
heads, one for the key heads), read straight out of the fused qkv projection (no copy first) and written contiguous
for the rotary kernel, or to any strided output, the input itself included. Rounding as HF's RMSNorm: normalise in
fp32, cast to x's dtype, then scale; or, for Gemma 3's q/k norms (`gemma=True`), as HF's Gemma3RMSNorm: scale by
(1 + weight) in fp32, then cast."""

from __future__ import annotations

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
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)


@triton.jit
def _qk_rms_norm_kernel(
    x_ptr,  # [N, Hq + Hk, D], heads D apart or more
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    out_ptr,  # [N, Hq + Hk, D], may be x itself (each program reads its heads before writing them)
    stride_xn,
    stride_xh,
    stride_on,
    stride_oh,
    num_heads,
    num_q_heads,
    head_dim,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GEMMA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    x = tl.load(x_ptr + token * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [BLOCK_H, BLOCK_D]
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)  # [BLOCK_H]
    q_weight = tl.load(q_weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    k_weight = tl.load(k_weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    weight = tl.where((offs_h < num_q_heads)[:, None], q_weight[None, :], k_weight[None, :])
    if GEMMA:  # (x * inv_rms) * (1 + w) in fp32, one rounding at the end
        scaled = x * inv_rms[:, None] * (1.0 + weight)
    else:  # Llama/Qwen: round the normalised x first, then scale
        scaled = weight * (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    out = out_ptr + token * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, scaled.to(out_ptr.dtype.element_ty), mask=mask)


def qk_rms_norm(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    gemma: bool = False,
) -> torch.Tensor:
    """qk: [N, Hq + Hk, D] (the query heads, then the key heads; any token/head strides, e.g. a view into a fused
    qkv), q_weight/k_weight: [D] -> [N, Hq + Hk, D] in qk's dtype, each head RMS-normalised and scaled by its
    weight: a new contiguous tensor, or `out` (any token/head strides; `out=qk` normalises in place). `gemma`: scale
    by (1 + weight) before rounding, as Gemma 3's q_norm/k_norm."""
    device = check_device(qk=qk, q_weight=q_weight, k_weight=k_weight)
    check_dtype("qk", qk, FLOAT_DTYPES)
    check_shape("qk", qk, (None, None, None))
    num_tokens, num_heads, head_dim = qk.shape
    assert 0 < num_q_heads < num_heads, f"num_q_heads {num_q_heads}: qk has {num_heads} heads"
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_dtype(name, w, (qk.dtype,))
        check_shape(name, w, (head_dim,))
    check_inner_contiguous("qk", qk)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=qk.dtype, device=device)
    assert out.shape == qk.shape and out.dtype == qk.dtype and out.device == device, (
        f"out: {out.dtype} {tuple(out.shape)} on {out.device}, expected {qk.dtype} {tuple(qk.shape)} on {device}"
    )
    check_inner_contiguous("out", out)
    if num_tokens == 0:
        return out
    block_h = min(pow2_at_least(num_heads), 16)
    grid = (num_tokens, cdiv(num_heads, block_h))
    _qk_rms_norm_kernel[grid](
        qk, q_weight.contiguous(), k_weight.contiguous(), out, qk.stride(0), qk.stride(1), out.stride(0),
        out.stride(1), num_heads, num_q_heads, head_dim, eps, BLOCK_H=block_h, BLOCK_D=pow2_at_least(head_dim, 16),
        GEMMA=gemma, num_warps=4, **pdl_launch(device),
    )  # fmt: skip
    return out
