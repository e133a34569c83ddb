"""Split-K flash decoding: one query per sequence attends to its cached tokens. One kernel runs one program per
(sequence, KV head, key chunk), all query heads of the KV head's group together (each K/V row is read once). A
sequence whose keys fit one chunk writes its output directly; otherwise each chunk writes a partial softmax, and the
last chunk of the (sequence, KV head) to finish merges them all (an arrival counter per pair), in chunk order, so the
result does not depend on which chunk arrives last. The counters return to zero as each merge starts, so a captured
graph replays with them zeroed. Each sequence splits its own keys evenly over its chunks, so a short sequence in a
graph captured for long ones still spreads over the grid. The grid depends only on tensor shapes and `max_seq_len`,
the chunk count is a runtime integer (no recompilation per batch size), and nothing reads GPU values on the host,
so the whole call can be captured in a CUDA graph. (Beyond `_FUSED_MERGE_MAX_CHUNKS` chunks a second kernel merges
instead, in parallel.)"""

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
    multiprocessor_count,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)

_MAX_CHUNKS = 64  # the two-launch merge kernel merges all chunks of a head in one tile
_PROGRAMS_PER_SM = 4  # enough programs in flight to cover HBM latency
_MIN_CHUNK = 64  # keys: a sequence splits into chunks of at least this many (a short one takes fewer chunks)
# Where the (sequence, KV head) pairs alone reach this many per SM, chunks are at least _MIN_CHUNK_WIDE keys: the
# grid is full without short chunks, whose merge costs more than their parallelism gives. On an H100 (same bench):
# 19.0 against 21.6 us a layer at batch 64 and 300 keys, 32.1 against 37.4 at 128, level at 1200 keys.
_WIDE_PAIRS_PER_SM = 1
_MIN_CHUNK_WIDE = 512
# Up to this many chunks the last chunk to finish merges (one launch); beyond, a second, merge kernel merges in
# parallel. On an H100 (kernels_bench --only decode_split: Qwen2-VL-7B's heads, each of 28 layers reading its own
# cache from HBM) the fused merge won at batch 64 (3 chunks: 21.6 against 28.0 us a layer at 300 keys, 63.2 against
# 68.9 at 1200) and batch 32 (5 chunks: 14.5 against 16.6 us at 300 keys, level at 1200), and lost at batch 16 and 1
# (9 and 64 chunks of 1200 keys: 22.4 against 21.9 us, 10.7 against 6.7 us), where one program reading every chunk
# back is the slow part.
_FUSED_MERGE_MAX_CHUNKS = 8
_MERGE_TILE = 1024  # elements of the fused merge's [group, chunks, head dim] tile: few registers
_FP8_PER_HEAD = tl.constexpr(KV_FP8_PER_HEAD)


# The chunk count is not specialized, and the merge's tiles do not depend on it, so that decode-graph capture (one
# chunk count per batch size) compiles each kernel once rather than once per value class: minutes of start-up on a
# machine whose Triton cache is cold.
@triton.jit(do_not_specialize=["num_chunks", "min_chunk"])
def _decode_partial_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [S, Hk, D]
    v_cache_ptr,  # [S, Hk, D]
    req_to_token_ptr,  # [R, L]
    b_req_idx_ptr,  # [B]
    b_seq_len_ptr,  # [B]
    out_ptr,  # [B, Hq, D] contiguous
    part_out_ptr,  # [B, Hq, C, D] fp32: each chunk's normalised output (unless SINGLE_CHUNK)
    part_lse_ptr,  # [B, Hq, C] fp32: each chunk's base-2 log-sum-exp
    arrivals_ptr,  # [>= B * Hk] int32, zero between launches: chunks of each (sequence, KV head) done (FUSED_MERGE)
    qk_scale,
    window,  # a sliding-window layer's window (read when WINDOWED): the last `window` keys only
    stride_q_b,
    stride_q_h,
    stride_k_slot,
    stride_k_h,
    stride_v_slot,
    stride_v_h,
    stride_req,
    k_scale_ptr,  # int8: [S, Hk]; fp8: [Hk]; unquantized: unused (kv_quant.py)
    v_scale_ptr,
    stride_scale_slot,
    num_chunks,  # the most chunks a sequence takes (the grid's third axis)
    min_chunk,  # keys: the shortest chunk worth its own program
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to a dot-friendly size
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_G: tl.constexpr,  # GROUP padded to a power of two (the fused merge's tile)
    MERGE_C: tl.constexpr,  # chunks the fused merge reads at a time
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WINDOWED: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.KV_*
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # before the early return below too
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    seq_len = tl.load(b_seq_len_ptr + seq)
    first = _first_key(seq_len, window, WINDOWED)
    chunk_len, used = _chunking(seq_len - first, num_chunks, min_chunk, BLOCK_N)
    if chunk >= used:  # chunks past this sequence's share; nothing reads them
        return
    start = first + chunk * chunk_len
    end = tl.minimum(seq_len, start + chunk_len)
    req = tl.load(b_req_idx_ptr + seq).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g  # the query heads that read this KV head
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = seq.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :]
    q = load_rows(q_ptr + q_rows, g_mask, d_mask, MASK_ROWS=True, EVEN_D=EVEN_D)

    if KV_QUANT == _FP8_PER_HEAD:  # this head's K scale multiplies every score: fold it into the softmax scale
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_key_tile(
            acc, m_i, l_i, q, offs_g, offs_g, offs_g, start_n, end, req_to_token_ptr + req * stride_req,
            k_cache_ptr + kv_head * stride_k_h, v_cache_ptr + kv_head * stride_v_h,
            k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_k_slot, stride_v_slot, stride_scale_slot,
            offs_d, d_mask, qk_scale,
            MASKED=True, CAUSAL=False, BOUNDED=False, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
            DOT_PRECISION=DOT_PRECISION, DOT_FP32=DOT_FP32, KV_QUANT=KV_QUANT,
        )  # fmt: skip
    if KV_QUANT == _FP8_PER_HEAD:  # and its V scale every output
        acc = acc * tl.load(v_scale_ptr + kv_head)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty sequence yields zeros, as the reference does
    store_mask = g_mask[:, None] & d_mask[None, :]
    out_rows = (seq.to(tl.int64) * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
    if SINGLE_CHUNK:
        tl.store(out_ptr + out_rows, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # A sequence whose keys fit one chunk writes its output; others their partials (masks, not branches: one
        # tile conversion for both stores)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + out_rows, o.to(out_ptr.dtype.element_ty), mask=store_mask & (used == 1))
        part_rows = (seq.to(tl.int64) * NUM_HEADS + heads) * num_chunks + chunk  # [BLOCK_H]
        part_mask = g_mask & (used > 1)
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=part_mask[:, None] & d_mask)
        tl.store(part_lse_ptr + part_rows, m_i + tl.log2(l_safe), mask=part_mask)
        if FUSED_MERGE and used > 1:
            _merge_if_last(
                part_out_ptr, part_lse_ptr, out_ptr, arrivals_ptr + seq * tl.num_programs(1) + kv_head, seq, kv_head,
                used, num_chunks, NUM_HEADS, GROUP, HEAD_DIM, MERGE_G, MERGE_C, BLOCK_D, EVEN_D,
            )  # fmt: skip


@triton.jit
def _first_key(seq_len, window, WINDOWED: tl.constexpr):
    """The first key a decode query sees: 0, or the start of its sliding window."""
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    return first


@triton.jit
def _chunking(keys, num_chunks, min_chunk, BLOCK_N: tl.constexpr):
    """How a sequence of `keys` keys splits -> (chunk length, chunks used): at most num_chunks chunks of at least
    min_chunk keys (at least one chunk, for an empty sequence too), equal to within a key tile."""
    tiles = tl.maximum(tl.cdiv(tl.cdiv(keys, num_chunks), BLOCK_N), tl.cdiv(min_chunk, BLOCK_N))
    used = tl.maximum(tl.cdiv(keys, tl.maximum(tiles, 1) * BLOCK_N), 1)  # <= num_chunks
    return tl.maximum(tl.cdiv(tl.cdiv(keys, used), BLOCK_N), 1) * BLOCK_N, used  # spread evenly over those


@triton.jit
def _merge_if_last(
    part_out_ptr, part_lse_ptr, out_ptr, arrivals_ptr, seq, kv_head, used, num_chunks,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_C: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """Count this chunk in; the (sequence, KV head)'s last chunk to arrive merges every chunk's partials, read back
    in chunk order (the same sums whichever chunk arrives last), writes the output and zeroes the counter."""
    # Every thread's partial stores before the counter's release; the acquire makes the other chunks' visible.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == used - 1:
        tl.store(arrivals_ptr, 0)  # for the next launch: nothing else touches it in this one
        offs_g = tl.arange(0, MERGE_G)
        g_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        rows = (seq.to(tl.int64) * NUM_HEADS + heads) * num_chunks  # [MERGE_G]: each head's chunk 0
        offs_c = tl.arange(0, MERGE_C)
        offs_d = tl.arange(0, BLOCK_D)
        m = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
        total = tl.zeros([MERGE_G], dtype=tl.float32)
        acc = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
        for c0 in range(0, used, MERGE_C):
            gc = rows[:, None] + (c0 + offs_c)[None, :]  # [MERGE_G, MERGE_C]
            gc_mask = g_mask[:, None] & ((c0 + offs_c) < used)[None, :]
            # .cg: from L2, where the other programs' stores are, not from this SM's (incoherent) L1
            lse = tl.load(part_lse_ptr + gc, mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
            part_mask = gc_mask[:, :, None]
            if not EVEN_D:
                part_mask = part_mask & (offs_d < HEAD_DIM)[None, None, :]
            parts = tl.load(
                part_out_ptr + gc[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=part_mask,
                other=0.0,
                cache_modifier=".cg",
            )  # [MERGE_G, MERGE_C, BLOCK_D]
            m_new = tl.maximum(m, tl.max(lse, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads: no chunk
            alpha = tl.exp2(m - m_use)
            weights = tl.exp2(lse - m_use[:, None])  # [MERGE_G, MERGE_C]
            total = total * alpha + tl.sum(weights, 1)
            acc = acc * alpha[:, None] + tl.sum(parts * weights[:, :, None], 1)
            m = m_new
        merged = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        out_rows = (seq.to(tl.int64) * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
        out_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(out_ptr + out_rows, merged.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_chunks", "min_chunk"])
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, C, D] fp32
    part_lse_ptr,  # [B, Hq, C] fp32
    b_seq_len_ptr,  # [B]
    out_ptr,  # [B, Hq, D] contiguous
    window,
    num_chunks,
    min_chunk,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the partial kernel's key tile (chunk lengths are multiples of it)
    BLOCK_C: tl.constexpr,  # _MAX_CHUNKS, masked to the chunks in use
    BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(b_seq_len_ptr + seq)
    _, used_chunks = _chunking(seq_len - _first_key(seq_len, window, WINDOWED), num_chunks, min_chunk, BLOCK_N)
    if used_chunks == 1:  # the partial kernel wrote this sequence's output
        return
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_mask = offs_c < used_chunks
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_chunks
    lse = tl.load(part_lse_ptr + row + offs_c, mask=c_mask, other=float("-inf"))  # [BLOCK_C]
    parts = tl.load(
        part_out_ptr + (row + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=c_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_C, BLOCK_D]
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - lse_max)  # two chunks or more, each of at least one key: lse_max is finite
    merged = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


def _launch_config() -> dict[str, int]:
    if interpreting():  # small tiles keep the interpreter fast and exercise several tiles per chunk
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


def decode_split(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Chunks per sequence: just enough programs to fill the GPU, and no more than the longest sequence has key
    tiles. Depends only on shapes and launch-time ints, so a captured graph keeps a valid split."""
    block_n = _launch_config()["BLOCK_N"]
    target = _PROGRAMS_PER_SM * multiprocessor_count(device)
    wanted = cdiv(target, max(batch * num_kv_heads, 1))
    return max(1, min(wanted, cdiv(max_seq_len, block_n), _MAX_CHUNKS))


def shortest_chunk(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The fewest keys a chunk takes (a launch-time int, fixed for a captured batch size): long chunks where the
    pairs alone fill the GPU, else _MIN_CHUNK."""
    wide = batch * num_kv_heads >= _WIDE_PAIRS_PER_SM * multiprocessor_count(device)
    return _MIN_CHUNK_WIDE if wide else _MIN_CHUNK


_arrival_buffers: dict[torch.device, torch.Tensor] = {}
_retired_buffers: list[torch.Tensor] = []  # outgrown, but captured graphs may still count in them


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters on `device`, zero whenever no launch is running (each merge re-zeroes its
    own). Allocated outside graph capture (the warm-up run before a capture sizes them), and never freed."""
    counters = _arrival_buffers.get(device)
    if counters is None or counters.numel() < count:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
            "decode attention's arrival counters must be sized before graph capture: run the same shapes eagerly first"
        )
        if counters is not None:
            _retired_buffers.append(counters)
        counters = _arrival_buffers[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return counters


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_seq_len: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `decode_attention_ref`: q [B, Hq, D] (any batch/head strides); sequence b attends to its
    b_seq_len[b] cached tokens, req_to_token[b_req_idx[b], :b_seq_len[b]]. Returns [B, Hq, D] in q's dtype.
    max_seq_len: an upper bound on b_seq_len (default: req_to_token's width); keys past it are not read.
    window > 0 (a sliding-window layer): only the last `window` keys; a plain int, so a captured graph replays each
    layer's own.
    k_scale/v_scale: an int8 or float8 cache's scales (kv_quant.py)."""
    device = check_device(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, b_req_idx=b_req_idx, b_seq_len=b_seq_len
    )
    num_heads, num_kv_heads, head_dim = check_attention_operands(q, k_cache, v_cache, req_to_token)
    kv_quant = kv_quant_scheme(k_cache, v_cache, k_scale, v_scale)
    if kv_quant != KV_PLAIN:
        check_device(q=q, k_scale=k_scale, v_scale=v_scale)
    batch = q.shape[0]
    for name, t in (("b_req_idx", b_req_idx), ("b_seq_len", b_seq_len)):
        check_dtype(name, t, INDEX_DTYPES)
        check_shape(name, t, (batch,))
    assert scale > 0, f"scale must be positive, got {scale}"  # the kernel applies it after the row max
    if max_seq_len is None:
        max_seq_len = req_to_token.shape[1]
    assert max_seq_len >= 1, f"max_seq_len must be positive, got {max_seq_len}"
    assert window >= 0, f"window must be >= 0, got {window}"
    keys = min(max_seq_len, window) if window else max_seq_len  # the most keys one query reads
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=device)
    check_out(out, (batch, num_heads, head_dim), q.dtype, device)
    if batch == 0:
        return out
    b_req_idx, b_seq_len = b_req_idx.contiguous(), b_seq_len.contiguous()

    group = num_heads // num_kv_heads
    num_chunks = decode_split(batch, num_kv_heads, keys, device)
    min_chunk = shortest_chunk(batch, num_kv_heads, device)
    single, fused = num_chunks == 1, num_chunks <= _FUSED_MERGE_MAX_CHUNKS
    # Scratch for the partial results; under graph capture these come from the graph's private pool.
    parts = 1 if single else num_chunks
    part_out = torch.empty((batch, num_heads, parts, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, num_heads, parts), dtype=torch.float32, device=device)
    arrivals = arrival_counters(device, batch * num_kv_heads) if fused and not single else part_lse  # else unused
    block_d = pow2_at_least(head_dim, 16)
    merge_g = pow2_at_least(group)
    config = _launch_config()
    _decode_partial_kernel[(batch, num_kv_heads, num_chunks)](
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, out, part_out, part_lse, arrivals,
        scale * LOG2E, window, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,  # unused when plain
        num_kv_heads, num_chunks, min_chunk,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, SINGLE_CHUNK=single, FUSED_MERGE=fused,
        BLOCK_H=pow2_at_least(group, 16), BLOCK_D=block_d, MERGE_G=merge_g,
        MERGE_C=max(1, min(_MAX_CHUNKS, _MERGE_TILE // (merge_g * block_d))), EVEN_D=block_d == head_dim,
        DOT_PRECISION=dot_precision(q.dtype), DOT_FP32=dot_in_fp32(q.dtype), WINDOWED=window > 0, KV_QUANT=kv_quant,
        **config, **pdl_launch(device),
    )  # fmt: skip
    if not single and not fused:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, b_seq_len, out, window, num_chunks, min_chunk,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_N=config["BLOCK_N"],
            BLOCK_C=_MAX_CHUNKS, BLOCK_D=block_d, WINDOWED=window > 0, num_warps=4, **pdl_launch(device),
        )  # fmt: skip
    return out
