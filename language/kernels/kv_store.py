"""Write a step's new K/V rows into their token slots of the KV cache (TokenAttention: one slot per token)."""

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
    check_shape,
    pow2_at_least,
)


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    k_ptr,  # [N, Hk, D]
    v_ptr,  # [N, Hk, D]
    slots_ptr,  # [N]
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_k_n,
    stride_k_h,
    stride_v_n,
    stride_v_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + token).to(tl.int64)  # int64: slot * stride can pass 2**31 on big caches
    k = tl.load(k_ptr + token * stride_k_n + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_n + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache/v_cache: [S, Hk, D]; k/v: [N, Hk, D] (any token/head strides); slots: [N] -> k_cache[slots] = k,
    v_cache[slots] = v, in place, cast to the cache dtype. Slots must be distinct (the allocator guarantees it)."""
    check_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slots=slots)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        check_dtype(name, t, FLOAT_DTYPES)
        check_inner_contiguous(name, t)
    check_dtype("slots", slots, INDEX_DTYPES)
    check_shape("k_cache", k_cache, (None, None, None))
    _, num_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("k", k, (None, num_heads, head_dim))
    num_tokens = k.shape[0]
    check_shape("v", v, (num_tokens, num_heads, head_dim))
    check_shape("slots", slots, (num_tokens,))
    if num_tokens == 0:
        return
    slots = slots.contiguous()
    block_h = min(pow2_at_least(num_heads), 16)
    grid = (num_tokens, cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k_cache, v_cache, k, v, slots,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=pow2_at_least(head_dim, 16), num_warps=4,
    )  # fmt: skip
