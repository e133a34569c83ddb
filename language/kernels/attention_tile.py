"""The flash-attention inner step shared by prefill and decode attention: one tile of keys, gathered from the KV cache
through token slots, folded into a running (online) softmax.

A quantized cache (language/kernels/kv_quant.py) is dequantized inside the tile: its int8 or e4m3 values convert
exactly to q's dtype for the tensor cores, and the scales are applied in fp32 where they cost least: int8's per-key
scales to the score columns (for K) and to the softmax weights before P @ V (for V); fp8's per-head scales, one
number per program, by the kernels outside their key loops (folded into qk_scale, and into the output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.kv_quant import KV_INT8_PER_TOKEN, KV_PLAIN

_PLAIN, _INT8 = tl.constexpr(KV_PLAIN), tl.constexpr(KV_INT8_PER_TOKEN)
LOG2E = 1.4426950408889634  # scores are kept in base 2 so the kernels can use exp2


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (tf32 would drift from the reference); half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_rows(ptrs, row_mask, d_mask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile with only the masks it needs: a mask that varies along the head dim would split
    the 16-byte vector loads into single elements, so it is applied only to padded head dims (not EVEN_D)."""
    if EVEN_D:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return tile


@triton.jit
def _dequant_operand(tile, dtype: tl.constexpr, DOT_FP32: tl.constexpr):
    """An int8 or e4m3 tile as a dot operand in `dtype` (its values are exact in fp16, bf16 and fp32); with DOT_FP32
    straight to fp32, since the interpreter casts integers to bf16 as raw bits."""
    if DOT_FP32:
        tile = tile.to(tl.float32)
    else:
        tile = tile.to(dtype)
    return tile


@triton.jit
def attend_key_tile(
    acc,  # [BLOCK_M, BLOCK_D] fp32, un-normalised output
    m_i,  # [BLOCK_M] running max of the (base-2) scores
    l_i,  # [BLOCK_M] running softmax denominator
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M] absolute position of each query (only read when CAUSAL)
    key_lo,  # [BLOCK_M] first key each query sees (only read when BOUNDED)
    key_hi,  # [BLOCK_M] the key past the last one each query sees (only read when BOUNDED)
    start_n,
    end_n,  # keys at or past end_n are masked out (only read when MASKED)
    slot_row_ptr,  # req_to_token row of this sequence
    k_head_ptr,  # k_cache at this KV head
    v_head_ptr,
    k_scale_head_ptr,  # int8: the [S, Hk] scales at this KV head (read only when KV_QUANT is int8)
    v_scale_head_ptr,
    stride_k_slot,
    stride_v_slot,
    stride_scale_slot,
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]: offs_d < head_dim (head dims that are not a power of two are padded)
    qk_scale,  # softmax scale * log2(e)
    MASKED: tl.constexpr,  # mask keys >= end_n
    CAUSAL: tl.constexpr,  # mask keys after each query's position
    BOUNDED: tl.constexpr,  # mask keys outside each query's [key_lo, key_hi) (sliding window, bidirectional blocks)
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D: no mask along the head dim
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # see dot_in_fp32
    KV_QUANT: tl.constexpr,  # kv_quant.KV_*: how the cache stores K and V
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end_n
    if MASKED:
        slots = tl.load(slot_row_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
    else:
        slots = tl.load(slot_row_ptr + offs_n).to(tl.int64)
    k_ptrs = k_head_ptr + slots[:, None] * stride_k_slot + offs_d[None, :]
    k = load_rows(k_ptrs, n_mask, d_mask, MASK_ROWS=MASKED, EVEN_D=EVEN_D)  # [BLOCK_N, BLOCK_D]
    if KV_QUANT != _PLAIN:
        k = _dequant_operand(k, q.dtype, DOT_FP32)
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if KV_QUANT == _INT8:  # masked keys read slot 0's scale (a finite number) and are masked below
        qk = qk * tl.load(k_scale_head_ptr + slots * stride_scale_slot)[None, :]
    if MASKED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    if CAUSAL:
        qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
    if BOUNDED:
        seen = (offs_n[None, :] >= key_lo[:, None]) & (offs_n[None, :] < key_hi[:, None])
        qk = tl.where(seen, qk, float("-inf"))
    # The scale (> 0, checked by the launchers) commutes with the max, so it is applied once per score inside the
    # exponent's argument (one FMA) instead of as a separate multiply over the whole tile.
    # Unbounded, every row sees key 0 in the first tile, so m_new is finite from then on and no row divides -inf by
    # -inf; bounded, a row may see nothing of a tile yet, and its max stands in at 0 until it does.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if BOUNDED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_head_ptr + slots[:, None] * stride_v_slot + offs_d[None, :]  # the K tile's slots, reused
    v = load_rows(v_ptrs, n_mask, d_mask, MASK_ROWS=MASKED, EVEN_D=EVEN_D)
    if KV_QUANT == _INT8:  # P @ (V * s) = (P * s) @ V, s per key: [BLOCK_M, BLOCK_N] products, not [BLOCK_N, BLOCK_D]
        p = p * tl.load(v_scale_head_ptr + slots * stride_scale_slot)[None, :]
    if KV_QUANT != _PLAIN:
        v = _dequant_operand(v, q.dtype, DOT_FP32)
    p = p.to(v.dtype)  # the tensor cores take P in the input dtype, as in every flash kernel
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    # Accumulate into the rescaled acc inside the dot (the MMA's own accumulator), not through a separate add.
    acc = acc * alpha[:, None]
    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
