"""Rotary embedding and the KV-cache write in one launch: a step's fused qkv rows -> rotated q (returned), and
rotated k and plain v written straight into their token slots. Bit-identical to `apply_rotary` on q and k followed
by `store_kv`; one kernel instead of two per layer matters at batch 1, where a decode step is ~400 launches and
every launch costs about a microsecond of GPU idle even inside a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    pow2_at_least,
)


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,  # [N, Hq + 2 Hk, D]: q heads, then k heads, then v heads of each token
    cos_ptr,  # [N, D/2]
    sin_ptr,  # [N, D/2]
    q_out_ptr,  # [N, Hq, D] contiguous
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    slots_ptr,  # [N]
    stride_xn,
    stride_xh,
    stride_cos,
    stride_sin,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] over q, k and v heads
    offs_f = tl.arange(0, BLOCK_HALF)
    f_mask = offs_f < HALF
    is_q = heads < NUM_Q_HEADS
    is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_Q_HEADS + NUM_KV_HEADS) & (heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    mask = (is_q | is_k | is_v)[:, None] & f_mask[None, :]
    dtype = qkv_ptr.dtype.element_ty
    # As apply_rotary (and HF): cos/sin cast to x's dtype, rounding after each product and after the sum.
    cos = tl.load(cos_ptr + token * stride_cos + offs_f, mask=f_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + offs_f, mask=f_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    x_row = qkv_ptr + token * stride_xn + heads[:, None] * stride_xh + offs_f[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    rot1 = ((a * cos).to(dtype).to(tl.float32) + (-b * sin).to(dtype).to(tl.float32)).to(dtype)
    rot2 = ((b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)).to(dtype)

    q_row = q_out_ptr + (token * NUM_Q_HEADS + heads[:, None]) * 2 * HALF + offs_f[None, :]
    q_mask = is_q[:, None] & f_mask[None, :]
    tl.store(q_row, rot1, mask=q_mask)
    tl.store(q_row + HALF, rot2, mask=q_mask)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # int64: slot * stride can pass 2**31 on big caches
    k_row = k_cache_ptr + slot * stride_kc_s + (heads[:, None] - NUM_Q_HEADS) * stride_kc_h + offs_f[None, :]
    k_mask = is_k[:, None] & f_mask[None, :]
    cache_dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_row, rot1.to(cache_dtype), mask=k_mask)
    tl.store(k_row + HALF, rot2.to(cache_dtype), mask=k_mask)
    v_head = heads[:, None] - NUM_Q_HEADS - NUM_KV_HEADS
    v_row = v_cache_ptr + slot * stride_vc_s + v_head * stride_vc_h + offs_f[None, :]
    v_mask = is_v[:, None] & f_mask[None, :]
    tl.store(v_row, x1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_row + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rotary_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv: [N, Hq + 2 Hk, D] (q heads, k heads, v heads; any token/head strides), cos/sin: [N, D/2],
    k_cache/v_cache: [S, Hk, D], slots: [N] distinct -> rotated q [N, Hq, D] in qkv's dtype; rotated k and v are
    written to k_cache[slots] and v_cache[slots] (cast to the cache dtype). qkv itself is left untouched."""
    device = check_device(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slots=slots)
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, FLOAT_DTYPES)
        check_inner_contiguous(name, t)
    check_dtype("slots", slots, INDEX_DTYPES)
    check_shape("k_cache", k_cache, (None, None, None))
    _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    assert head_dim % 2 == 0, f"head dim {head_dim} must be even"
    check_shape("qkv", qkv, (None, num_heads + 2 * num_kv_heads, head_dim))
    num_tokens = qkv.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        check_shape(name, t, (num_tokens, head_dim // 2))
    check_shape("slots", slots, (num_tokens,))
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=device)
    check_out(out, (num_tokens, num_heads, head_dim), qkv.dtype, device)
    if num_tokens == 0:
        return out
    slots = slots.contiguous()
    total_heads = num_heads + 2 * num_kv_heads
    block_h = min(pow2_at_least(total_heads), 16)
    grid = (num_tokens, cdiv(total_heads, block_h))
    _rotary_store_kernel[grid](
        qkv, cos, sin, out, k_cache, v_cache, slots,
        qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, BLOCK_H=block_h,
        BLOCK_HALF=pow2_at_least(head_dim // 2, 16), num_warps=4,
    )  # fmt: skip
    return out
