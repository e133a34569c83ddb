"""Write a step's new K/V rows into their token slots of the KV cache (TokenAttention: one slot per token), quantizing
them on the way where the cache is int8 or fp8 (language/kernels/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.kv_quant import FP8_MAX, INT8_MAX, KV_INT8_PER_TOKEN, KV_PLAIN, QUANT_DTYPES, kv_quant_scheme
from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
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

# The kernels read module constants only as constexprs.
_PLAIN, _INT8 = tl.constexpr(KV_PLAIN), tl.constexpr(KV_INT8_PER_TOKEN)
_INT8_MAX, _FP8_MAX = tl.constexpr(INT8_MAX), tl.constexpr(FP8_MAX)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, within +-448) rounded to the nearest e4m3 value, ties to even, still in fp32: adding and taking away
    1.5 * 2^23 ulps rounds to a whole number of ulps. Only under the interpreter, whose fp32 -> fp8 cast truncates
    the mantissa without carrying into the exponent (1.96 -> 1.0); a GPU's cast rounds exactly this way itself."""
    size = tl.abs(x)
    exponent = tl.maximum(tl.floor(tl.log2(size)), -6.0)  # e4m3's subnormals step by 2^-9
    magic = tl.exp2(exponent - 3.0) * 12582912.0
    rounded = (size + magic) - magic
    return tl.where(x < 0.0, -rounded, rounded)  # a tiny negative value rounds to -0, as the cast gives


@triton.jit
def encode_rows(x, mask, scale_ptr, scale_row, offs_h, h_mask, KV_QUANT: tl.constexpr, ROUND_FP8: tl.constexpr):
    """x [BLOCK_H, BLOCK_D]: one token's heads, valid where `mask` -> their values in the cache's encoding, before
    the cast. int8: a scale per head, absmax / 127, stored at scale_ptr + scale_row + head; rounded half away from zero
    (the cast then truncates). fp8: divided by the head's fixed scale (scale_ptr[head]), clamped to e4m3's range."""
    x = tl.where(mask, x.to(tl.float32), 0.0)  # masked lanes of a load are undefined: keep them out of the absmax
    if KV_QUANT == _INT8:
        absmax = tl.max(tl.abs(x), 1)  # [BLOCK_H]
        # div_rn: IEEE division, as the reference's (a GPU's fp32 `/` is approximate, a few ulps)
        tl.store(scale_ptr + scale_row + offs_h, tl.math.div_rn(absmax, _INT8_MAX), mask=h_mask)
        x = x * tl.where(absmax > 0.0, tl.math.div_rn(_INT8_MAX, absmax), 0.0)[:, None]
        x = tl.where(x >= 0.0, x + 0.5, x - 0.5)
    else:
        inv = 1.0 / tl.load(scale_ptr + offs_h, mask=h_mask, other=1.0)  # [BLOCK_H]
        x = tl.minimum(tl.maximum(x * inv[:, None], -_FP8_MAX), _FP8_MAX)
        if ROUND_FP8:
            x = _round_to_e4m3(x)
    return x


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    k_ptr,  # [N, Hk, D]
    v_ptr,  # [N, Hk, D]
    slots_ptr,  # [N]
    k_scale_ptr,  # int8: [S, Hk] written here; fp8: [Hk] read; unquantized: unused
    v_scale_ptr,
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
    KV_QUANT: tl.constexpr,  # kv_quant.KV_*
    ROUND_FP8: tl.constexpr,  # see _round_to_e4m3
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_k_n + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_n + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    store_token_rows(
        k, v, tl.load(slots_ptr + token), offs_h, h_mask, offs_d, mask, k_cache_ptr, v_cache_ptr, k_scale_ptr,
        v_scale_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, num_heads, KV_QUANT, ROUND_FP8,
    )  # fmt: skip


@triton.jit
def store_token_rows(
    k, v, slot, heads, h_mask, offs_d, mask, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, num_heads, KV_QUANT: tl.constexpr, ROUND_FP8: tl.constexpr,
):  # fmt: skip
    """One token's k and v rows [BLOCK_H, BLOCK_D] (heads `heads`, valid where `mask`) to its cache slot, encoded as
    the cache stores them (encode_rows; an int8 cache's scales written beside the slot)."""
    slot = slot.to(tl.int64)  # int64: slot * stride can pass 2**31 on big caches
    if KV_QUANT != _PLAIN:
        k = encode_rows(k, mask, k_scale_ptr, slot * num_heads, heads, h_mask, KV_QUANT, ROUND_FP8)
        v = encode_rows(v, mask, v_scale_ptr, slot * num_heads, heads, h_mask, KV_QUANT, ROUND_FP8)
    k_dst = k_cache_ptr + slot * stride_kc_s + heads[:, None] * stride_kc_h + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vc_s + heads[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.device, int]:
    """store_kv's operands (see there), checked: also rotary_store_kv's caches, k (before its rotation) and v.
    Returns (the device, the cache's kv_quant scheme)."""
    device = check_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slots=slots)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        check_dtype(name, t, FLOAT_DTYPES + QUANT_DTYPES if name.endswith("cache") else FLOAT_DTYPES)
        check_inner_contiguous(name, t)
    check_dtype("slots", slots, INDEX_DTYPES)
    check_shape("k_cache", k_cache, (None, None, None))
    _, num_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    assert v_cache.dtype == k_cache.dtype, f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ"
    scheme = kv_quant_scheme(k_cache, v_cache, k_scale, v_scale)
    if scheme != KV_PLAIN:
        check_device(k_cache=k_cache, k_scale=k_scale, v_scale=v_scale)
    check_shape("k", k, (None, num_heads, head_dim))
    num_tokens = k.shape[0]
    check_shape("v", v, (num_tokens, num_heads, head_dim))
    check_shape("slots", slots, (num_tokens,))
    return device, scheme


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache/v_cache: [S, Hk, D]; k/v: [N, Hk, D] (any token/head strides); slots: [N] -> k_cache[slots] = k,
    v_cache[slots] = v, in place, cast to the cache dtype. Slots must be distinct (the allocator guarantees it).
    An int8 or float8 cache stores them quantized (kv_quant.py), with its scales: k_scale/v_scale [S, Hk] (int8,
    written here) or [Hk] (float8, read)."""
    device, scheme = check_store_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    slots = slots.contiguous()
    block_h = min(pow2_at_least(num_heads), 16)
    grid = (num_tokens, cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k_cache, v_cache, k, v, slots,
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,  # unused when plain
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=pow2_at_least(head_dim, 16), KV_QUANT=scheme,
        ROUND_FP8=interpreting(), num_warps=4,
        # int8 rounds (x * 127 / absmax) + 0.5 as the reference does, in two roundings: a fused multiply-add would
        # round once and move ties
        enable_fp_fusion=False, **pdl_launch(device),
    )  # fmt: skip
