"""The rotary embedding and the KV store in one launch: q and k rotated (rotary.py's arithmetic), q written out, the
rotated k and the unrotated v stored into their token slots of the KV cache in its encoding (kv_store.py's). One
launch a layer instead of two: at decode sizes each is a few microseconds of mostly launch and drain."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.kv_store import check_store_kv, store_token_rows
from language.kernels.launch_utils import (
    cdiv,
    check_out,
    interpreting,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)
from language.kernels.rotary import check_rotary

_MAX_BLOCK_HEADS = 16


@triton.jit
def _rotated_heads(row_ptr, stride_h, cos_row, sin_row, offs_h, offs_d, mask, HALF: tl.constexpr):
    """One token's heads offs_h [BLOCK_H] of x (whole rows of 2 * HALF, read at offs_d [BLOCK_D]) -> rotated
    (rotate-half style), in x's dtype. Each lane reads its own value and its partner half a row away, so the result
    has the cache's row layout; the roundings are apply_rotary's: cos/sin to x's dtype, then after each product and
    the sum."""
    dtype = row_ptr.dtype.element_ty
    first = offs_d < HALF
    band = tl.where(first, offs_d, offs_d - HALF)
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    d_mask = offs_d < 2 * HALF
    cos = tl.load(cos_row + band, mask=d_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_row + band, mask=d_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    rows = row_ptr + offs_h[:, None] * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    x_partner = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.where(first[None, :], -x_partner, x_partner)  # rotate_half: [-x2, x1]
    return ((x * cos).to(dtype).to(tl.float32) + (x_partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,  # [N, Hq, D]
    k_ptr,  # [N, Hk, D]
    v_ptr,  # [N, Hk, D]
    cos_ptr,  # [N, D/2]
    sin_ptr,  # [N, D/2]
    q_out_ptr,  # [N, Hq, D] contiguous
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    slots_ptr,  # [N]
    k_scale_ptr,  # int8: [S, Hk] written here; fp8: [Hk] read; unquantized: unused
    v_scale_ptr,
    stride_q_n,
    stride_q_h,
    stride_k_n,
    stride_k_h,
    stride_v_n,
    stride_v_h,
    stride_cos,
    stride_sin,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    num_q_heads,
    num_kv_heads,
    num_q_blocks,  # the programs along axis 1 below this rotate q; the rest rotate and store k, and store v
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.KV_*
    ROUND_FP8: tl.constexpr,  # see kv_store._round_to_e4m3
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < 2 * HALF
    cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_sin
    # (Triton wants a name bound in both branches to have one type: each branch has its own names.)
    if block < num_q_blocks:
        q_heads = block * BLOCK_QH + tl.arange(0, BLOCK_QH)
        q_mask = (q_heads < num_q_heads)[:, None] & d_mask[None, :]
        q = _rotated_heads(q_ptr + token * stride_q_n, stride_q_h, cos_row, sin_row, q_heads, offs_d, q_mask, HALF)
        q_dst = q_out_ptr + token * num_q_heads * 2 * HALF + q_heads[:, None] * 2 * HALF + offs_d[None, :]
        tl.store(q_dst, q, mask=q_mask)
    else:
        heads = (block - num_q_blocks) * BLOCK_KVH + tl.arange(0, BLOCK_KVH)
        h_mask = heads < num_kv_heads
        mask = h_mask[:, None] & d_mask[None, :]
        k = _rotated_heads(k_ptr + token * stride_k_n, stride_k_h, cos_row, sin_row, heads, offs_d, mask, HALF)
        v = tl.load(v_ptr + token * stride_v_n + heads[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        store_token_rows(
            k, v, tl.load(slots_ptr + token), heads, h_mask, offs_d, mask, k_cache_ptr, v_cache_ptr, k_scale_ptr,
            v_scale_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, num_kv_heads, KV_QUANT, ROUND_FP8,
        )  # fmt: skip


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hk, D] (any token/head strides, e.g. views into a fused qkv), cos/sin [N, D/2], caches
    [S, Hk, D], slots [N] -> q rotated, a new [N, Hq, D] in q's dtype (or `out`); k rotated and v stored at the
    slots, in place. Equal bit for bit to `apply_rotary` of q and of k, then `store_kv(k_cache, v_cache, rotated k,
    v, slots, k_scale=, v_scale=)`; q, k and v themselves are left untouched."""
    # q and k share cos/sin's device, token count and (twice its width) head dim; k and v the caches' (checked there).
    device = check_rotary("q", q, cos, sin)
    check_rotary("k", k, cos, sin)
    assert k.dtype == q.dtype, f"q {q.dtype} and k {k.dtype} differ"
    _, scheme = check_store_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=device)
    check_out(out, (num_tokens, num_q_heads, head_dim), q.dtype, device)
    if num_tokens == 0:
        return out
    slots = slots.contiguous()
    block_qh = min(pow2_at_least(num_q_heads), _MAX_BLOCK_HEADS)
    block_kvh = min(pow2_at_least(num_kv_heads), _MAX_BLOCK_HEADS)
    num_q_blocks = cdiv(num_q_heads, block_qh)
    grid = (num_tokens, num_q_blocks + cdiv(num_kv_heads, block_kvh))
    _rotary_store_kv_kernel[grid](
        q, k, v, cos, sin, out, k_cache, v_cache, slots,
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,  # unused when plain
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_q_heads, num_kv_heads, num_q_blocks,
        HALF=head_dim // 2, BLOCK_QH=block_qh, BLOCK_KVH=block_kvh, BLOCK_D=pow2_at_least(head_dim, 16),
        KV_QUANT=scheme, ROUND_FP8=interpreting(), num_warps=4,
        # no fused multiply-adds: the rotation rounds after each product (as the reference), and int8 rounds
        # (x * 127 / absmax) + 0.5 in two steps (store_kv)
        enable_fp_fusion=False, **pdl_launch(device),
    )  # fmt: skip
    return out
