"""Causal flash attention over packed ("nopad") prefill sequences whose K/V are already in the token-slot cache,
possibly behind a cached prefix. One program per (tile of query rows, sequence, group of PACK query heads).

GQA packing: with PACK = GROUP the query heads that share a KV head are stacked into one tile's rows (row r of the
flattened [q_len * PACK] index is query position r // PACK of head r % PACK), so each gathered K/V tile feeds all of
them at once instead of being fetched GROUP times by GROUP programs, and a tile spans only BLOCK_M / PACK positions,
which narrows the causal diagonal band that is computed and then masked away."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.attention_tile import LOG2E, attend_key_tile, dot_precision, load_rows
from language.kernels.kv_quant import KV_FP8_PER_HEAD, KV_PLAIN, kv_quant_scheme
from language.kernels.launch_utils import (
    INDEX_DTYPES,
    cdiv,
    check_attention_operands,
    check_device,
    check_dtype,
    check_out,
    check_shape,
    dot_in_fp32,
    interpreting,
    pow2_at_least,
)

_FP8_PER_HEAD = tl.constexpr(KV_FP8_PER_HEAD)


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [N, Hq, D]
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    out_ptr,  # [N, Hq, D] contiguous
    req_to_token_ptr,  # [R, L]
    b_req_idx_ptr,  # [B]
    b_q_start_ptr,  # [B]
    b_q_len_ptr,  # [B]
    b_seq_len_ptr,  # [B]
    key_ends_ptr,  # [N]: where each query's keys end at the latest (read when KEY_ENDS)
    qk_scale,
    window,  # sliding window in tokens (read when WINDOWED)
    stride_q_n,
    stride_q_h,
    stride_k_slot,
    stride_k_h,
    stride_v_slot,
    stride_v_h,
    stride_req,
    k_scale_ptr,  # int8: [S, Hk]; fp8: [Hk]; unquantized: unused (kv_quant.py)
    v_scale_ptr,
    stride_scale_slot,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    PACK: tl.constexpr,  # query heads stacked into one tile's rows: 1 or GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows (query position x packed head) per tile
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WINDOWED: tl.constexpr,
    KEY_ENDS: tl.constexpr,
    BOUNDED: tl.constexpr,  # WINDOWED or KEY_ENDS
    KV_QUANT: tl.constexpr,  # kv_quant.KV_*
):
    seq = tl.program_id(1)
    head_block = tl.program_id(2)
    q_len = tl.load(b_q_len_ptr + seq)
    num_rows = q_len * PACK
    # Heaviest tile first (the one nearest the sequence's end sees the most keys): a program that starts late on a
    # long tile would otherwise set the tail of the launch. The grid covers the longest sequence; others stop early.
    m_block = tl.cdiv(num_rows, BLOCK_M) - 1 - tl.program_id(0)
    if m_block < 0:
        return
    seq_len = tl.load(b_seq_len_ptr + seq)
    q_start = tl.load(b_q_start_ptr + seq).to(tl.int64)
    req = tl.load(b_req_idx_ptr + seq).to(tl.int64)
    kv_head = (head_block * PACK) // GROUP
    prefix_len = seq_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (position, packed head) rows
    pos = offs_m // PACK  # query index within the sequence
    heads = head_block * PACK + offs_m % PACK  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < num_rows
    tokens = q_start + pos  # [BLOCK_M] int64 rows of q/out
    q_rows = tokens[:, None] * stride_q_n + heads[:, None] * stride_q_h + offs_d[None, :]
    q = load_rows(q_ptr + q_rows, m_mask, d_mask, MASK_ROWS=True, EVEN_D=EVEN_D)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix_len + pos  # absolute positions of this tile's queries

    if KV_QUANT == _FP8_PER_HEAD:  # this head's K scale multiplies every score: fold it into the softmax scale
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    slot_row_ptr = req_to_token_ptr + req * stride_req
    k_head_ptr = k_cache_ptr + kv_head * stride_k_h
    v_head_ptr = v_cache_ptr + kv_head * stride_v_h
    k_scale_head_ptr = k_scale_ptr + kv_head  # read only by an int8 cache
    v_scale_head_ptr = v_scale_ptr + kv_head

    # Key tiles in three ranges: a ragged leading edge (a sliding window's start), tiles every row sees in full (no
    # masks at all) and a ragged trailing edge (the causal diagonal band, or a bidirectional block's end); tiles no
    # row sees are skipped.
    if BOUNDED:
        lo, hi, first, full_start, full_end, last = _bounded_key_ranges(
            q_pos, tokens, m_mask, key_ends_ptr, window, WINDOWED=WINDOWED, KEY_ENDS=KEY_ENDS, BLOCK_N=BLOCK_N
        )
        acc, m_i, l_i = _attend_key_range(
            acc, m_i, l_i, q, q_pos, lo, hi, first, tl.minimum(full_start, last), seq_len, slot_row_ptr, k_head_ptr,
            v_head_ptr, k_scale_head_ptr, v_scale_head_ptr, stride_k_slot, stride_v_slot, stride_scale_slot,
            offs_d, d_mask, qk_scale,
            MASKED=True, CAUSAL=False, BOUNDED=True, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
            DOT_PRECISION=DOT_PRECISION, DOT_FP32=DOT_FP32, KV_QUANT=KV_QUANT,
        )  # fmt: skip
        edge_start = tl.maximum(full_end, first)
    else:  # causal: lo and hi are unread
        lo = q_pos
        hi = q_pos
        full_start = 0
        full_end, last = _causal_key_ranges(prefix_len, q_len, m_block, PACK=PACK, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        edge_start = full_end
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, lo, hi, full_start, full_end, seq_len, slot_row_ptr, k_head_ptr, v_head_ptr,
        k_scale_head_ptr, v_scale_head_ptr, stride_k_slot, stride_v_slot, stride_scale_slot, offs_d, d_mask, qk_scale,
        MASKED=False, CAUSAL=False, BOUNDED=False, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
        DOT_PRECISION=DOT_PRECISION, DOT_FP32=DOT_FP32, KV_QUANT=KV_QUANT,
    )  # fmt: skip
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, lo, hi, edge_start, last, seq_len, slot_row_ptr, k_head_ptr, v_head_ptr,
        k_scale_head_ptr, v_scale_head_ptr, stride_k_slot, stride_v_slot, stride_scale_slot, offs_d, d_mask, qk_scale,
        MASKED=True, CAUSAL=not BOUNDED, BOUNDED=BOUNDED, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
        DOT_PRECISION=DOT_PRECISION, DOT_FP32=DOT_FP32, KV_QUANT=KV_QUANT,
    )  # fmt: skip

    if KV_QUANT == _FP8_PER_HEAD:  # and its V scale every output
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    out_rows = tokens[:, None] * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_D:
        tl.store(out_ptr + out_rows, out, mask=m_mask[:, None])
    else:
        tl.store(out_ptr + out_rows, out, mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_key_range(
    acc, m_i, l_i, q, q_pos, key_lo, key_hi, start, end, seq_len, slot_row_ptr, k_head_ptr, v_head_ptr,
    k_scale_head_ptr, v_scale_head_ptr, stride_k_slot, stride_v_slot, stride_scale_slot, offs_d, d_mask, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """attend_key_tile over the key tiles starting in [start, end), all with the same masks."""
    for start_n in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_key_tile(
            acc, m_i, l_i, q, q_pos, key_lo, key_hi, start_n, seq_len, slot_row_ptr, k_head_ptr, v_head_ptr,
            k_scale_head_ptr, v_scale_head_ptr, stride_k_slot, stride_v_slot, stride_scale_slot,
            offs_d, d_mask, qk_scale,
            MASKED=MASKED, CAUSAL=CAUSAL, BOUNDED=BOUNDED, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
            DOT_PRECISION=DOT_PRECISION, DOT_FP32=DOT_FP32, KV_QUANT=KV_QUANT,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _causal_key_ranges(prefix_len, q_len, m_block, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Plain causal attention: every key up to each query's position. Returns (full_end, last): the tiles before
    full_end hold only keys <= the tile's first row's position, which every row sees; the diagonal band runs up to
    last, past the last real row's position."""
    first_pos = prefix_len + (m_block * BLOCK_M) // PACK
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    last_pos = prefix_len + tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // PACK, q_len - 1)
    return full_end, last_pos + 1


@triton.jit
def _bounded_key_ranges(
    q_pos, tokens, m_mask, key_ends_ptr, window, WINDOWED: tl.constexpr, KEY_ENDS: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Each query sees the keys [lo, hi): lo = position - window + 1 in a sliding-window layer (else 0), hi = the
    position + 1 or, for a token of a bidirectional block, the block's end. Returns lo, hi and the tile bounds
    first <= full_start <= full_end (tiles in [full_start, full_end) are inside every row's range) and last."""
    hi = q_pos + 1
    if KEY_ENDS:
        hi = tl.maximum(hi, tl.load(key_ends_ptr + tokens, mask=m_mask, other=0))
    if WINDOWED:
        lo = tl.maximum(q_pos - window + 1, 0)
    else:
        lo = tl.zeros_like(q_pos)
    big = 1 << 30
    first = (tl.min(tl.where(m_mask, lo, big)) // BLOCK_N) * BLOCK_N  # the first tile some row sees
    last = tl.max(tl.where(m_mask, hi, 0))  # past the last key some row sees
    full_start = tl.cdiv(tl.max(tl.where(m_mask, lo, 0)), BLOCK_N) * BLOCK_N  # tiles every row sees in full
    full_end = tl.maximum((tl.min(tl.where(m_mask, hi, big)) // BLOCK_N) * BLOCK_N, full_start)
    return lo, hi, first, full_start, full_end, last


# Launch configurations for compiled kernels, first match wins: (max head_dim, max of max_q_len, config). An explicit
# table rather than triton.autotune, which would time every candidate at server start. PACK_GQA: stack the GQA
# group's heads into one tile (module docstring). The first row is the fastest, or within 5 % of it, on every
# serving shape but a lone 1129-token prompt, too small a case for a second key (docs/kernels_gpu_run.md, runs 3-4).
_CONFIG_TABLE: tuple[tuple[int, int, dict[str, int]], ...] = (
    (128, 1 << 30, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, PACK_GQA=1)),
    # Larger head dims (not run on a GPU yet): smaller tiles so that K, V and the accumulator fit.
    (1 << 30, 1 << 30, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, PACK_GQA=1)),
)


def _launch_config(head_dim: int, max_q_len: int) -> dict[str, int]:
    if interpreting():  # small tiles keep the interpreter fast and exercise several tiles per sequence
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, PACK_GQA=1)
    for max_head_dim, max_len, config in _CONFIG_TABLE:
        if head_dim <= max_head_dim and max_q_len <= max_len:
            return dict(config)
    raise AssertionError("unreachable: the table's last row matches everything")


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_q_start: torch.Tensor,
    b_q_len: torch.Tensor,
    b_seq_len: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    key_ends: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `prefill_attention_ref`: q [N, Hq, D] packed queries (any token/head strides), sequence b owns
    rows b_q_start[b]:+b_q_len[b], the last b_q_len[b] of its b_seq_len[b] tokens, whose K/V sit in the slots
    req_to_token[b_req_idx[b], :b_seq_len[b]]. Returns [N, Hq, D] in q's dtype.
    max_q_len: the longest b_q_len (sizes the grid); None reads it from b_q_len, which syncs with the GPU.
    window > 0: a sliding-window layer; key_ends [N]: bidirectional blocks (both as in the reference). Without
    either, the kernel compiles as plain causal attention.
    k_scale/v_scale: an int8 or float8 cache's scales (kv_quant.py)."""
    device = check_device(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, b_req_idx=b_req_idx,
        b_q_start=b_q_start, b_q_len=b_q_len, b_seq_len=b_seq_len,
    )  # fmt: skip
    num_heads, num_kv_heads, head_dim = check_attention_operands(q, k_cache, v_cache, req_to_token)
    kv_quant = kv_quant_scheme(k_cache, v_cache, k_scale, v_scale)
    if kv_quant != KV_PLAIN:
        check_device(q=q, k_scale=k_scale, v_scale=v_scale)
    num_tokens = q.shape[0]
    batch = b_req_idx.shape[0]
    for name, t in (("b_req_idx", b_req_idx), ("b_q_start", b_q_start), ("b_q_len", b_q_len), ("b_seq_len", b_seq_len)):
        check_dtype(name, t, INDEX_DTYPES)
        check_shape(name, t, (batch,))
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    check_out(out, (num_tokens, num_heads, head_dim), q.dtype, device)
    assert scale > 0, f"scale must be positive, got {scale}"  # the kernel applies it after the row max
    assert window >= 0, f"window must be >= 0, got {window}"
    if key_ends is not None:
        check_device(q=q, key_ends=key_ends)
        check_dtype("key_ends", key_ends, INDEX_DTYPES)
        check_shape("key_ends", key_ends, (num_tokens,))
        key_ends = key_ends.contiguous()
    if max_q_len is None:
        max_q_len = int(b_q_len.max()) if batch > 0 else 0
    if num_tokens == 0 or batch == 0 or max_q_len == 0:
        return out
    b_req_idx, b_q_start, b_q_len, b_seq_len = (t.contiguous() for t in (b_req_idx, b_q_start, b_q_len, b_seq_len))

    config = _launch_config(head_dim, max_q_len)
    group = num_heads // num_kv_heads
    pack = group if config.pop("PACK_GQA") else 1
    block_d = pow2_at_least(head_dim, 16)
    grid = (cdiv(max_q_len * pack, config["BLOCK_M"]), batch, num_heads // pack)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, b_req_idx, b_q_start, b_q_len, b_seq_len,
        b_q_len if key_ends is None else key_ends, scale * LOG2E, window, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,  # unused when plain
        num_kv_heads,
        NUM_HEADS=num_heads, GROUP=group, PACK=pack, HEAD_DIM=head_dim, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        DOT_PRECISION=dot_precision(q.dtype), DOT_FP32=dot_in_fp32(q.dtype), WINDOWED=window > 0,
        KEY_ENDS=key_ends is not None, BOUNDED=window > 0 or key_ends is not None, KV_QUANT=kv_quant, **config,
    )  # fmt: skip
    return out
