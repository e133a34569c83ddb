"""Non-causal flash attention over packed images (the vision towers' attention): every image of a batch in one token
sequence, kept apart by cu_seqlens; each image's patches attend to that image's patches only.

Why our own kernel: the Qwen-VL towers have head dim 80 (1280 wide, 16 heads), and FlashAttention-2 (torch's flash
backend) runs it in 96-wide tiles on sm80 code: half of a 7B-shaped tower's GPU time at 896 px, at ~260 TFLOP/s on
an H100. Here a head dim that is a power of two plus a smaller one (80 = 64 + 16) is computed in two exact parts,
q.k = q[:64].k[:64] + q[64:].k[64:] and out[:64], out[64:] = P.V[:64], P.V[64:], so no column is padded.

One program per (tile of BLOCK_M query rows, image, head). Key tiles that lie wholly inside the image run without
masks; in the image's last, partial key tile the keys past its end read its last row (every load stays inside the
image) and their scores are masked.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from visual.models.packed_attention import sdpa_per_segment

LOG2E = 1.4426950408889634  # scores are kept in base 2 so the kernel can use exp2


@triton.jit
def _attend(
    acc_lo,  # [BLOCK_M, D_LO] fp32 un-normalised output, first part of the head dim
    acc_hi,  # [BLOCK_M, D_HI] the rest (a placeholder when not SPLIT)
    m_i,  # [BLOCK_M] running max of the base-2 scores
    l_i,  # [BLOCK_M] running softmax denominator
    q_lo,  # [BLOCK_M, D_LO]
    q_hi,  # [BLOCK_M, D_HI]
    k_rows,  # [BLOCK_N] pointers to this key tile's rows (at the head), all inside the image
    v_rows,
    lo,  # [D_LO] column offsets of the first part
    hi,  # [D_HI] column offsets of the second
    n_mask,  # [BLOCK_N] keys inside the image: the others' scores are masked (read when MASK)
    qk_scale,
    SPLIT: tl.constexpr,
    MASK: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the interpreter's bf16 dot is wrong: upcast there
    PRECISION: tl.constexpr,
):
    k_lo = tl.load(k_rows[:, None] + lo[None, :])  # [BLOCK_N, D_LO]
    if FP32_DOT:
        q_lo, k_lo = q_lo.to(tl.float32), k_lo.to(tl.float32)
    qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if SPLIT:
        k_hi = tl.load(k_rows[:, None] + hi[None, :])  # [BLOCK_N, D_HI]
        if FP32_DOT:
            q_hi, k_hi = q_hi.to(tl.float32), k_hi.to(tl.float32)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=PRECISION)
    if MASK:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # the scale (> 0) commutes with the max
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_lo = tl.load(v_rows[:, None] + lo[None, :])
    p = p.to(v_lo.dtype)  # P in the input dtype for the tensor cores, as in every flash kernel
    if FP32_DOT:
        p, v_lo = p.to(tl.float32), v_lo.to(tl.float32)
    acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PRECISION)
    if SPLIT:
        v_hi = tl.load(v_rows[:, None] + hi[None, :])
        if FP32_DOT:
            v_hi = v_hi.to(tl.float32)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PRECISION)
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def _varlen_attention_kernel(
    q_ptr,  # [T, H, D] (any token and head strides, unit column stride)
    k_ptr,
    v_ptr,
    out_ptr,  # [T, H, D] contiguous
    cu_seqlens_ptr,  # [images + 1] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    H: tl.constexpr,
    D: tl.constexpr,
    D_LO: tl.constexpr,  # a power of two
    D_HI: tl.constexpr,  # D - D_LO: a power of two >= 16, or 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    SPLIT: tl.constexpr = D_HI > 0
    image = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + image)
    length = tl.load(cu_seqlens_ptr + image + 1) - start
    m_start = tl.program_id(0) * BLOCK_M
    if m_start >= length:  # the grid covers the longest image; shorter ones stop early
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = (start + offs_m).to(tl.int64)  # [BLOCK_M] token rows of this tile's queries
    lo = tl.arange(0, D_LO)
    hi = D_LO + tl.arange(0, D_HI if SPLIT else 16)  # a placeholder range when not SPLIT (never loaded)
    q_base = q_ptr + rows[:, None] * stride_qt + head * stride_qh
    q_lo = tl.load(q_base + lo[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D_LO]
    q_hi = q_lo
    if SPLIT:
        q_hi = tl.load(q_base + hi[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D_HI]
    acc_lo = tl.zeros([BLOCK_M, D_LO], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, D_HI if SPLIT else 16], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = k_ptr + start.to(tl.int64) * stride_kt + head * stride_kh
    v_base = v_ptr + start.to(tl.int64) * stride_vt + head * stride_vh
    full_end = (length // BLOCK_N) * BLOCK_N
    for n in range(0, full_end, BLOCK_N):  # key tiles wholly inside the image: no masks
        keys = (n + offs_n).to(tl.int64)
        acc_lo, acc_hi, m_i, l_i = _attend(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base + keys * stride_kt, v_base + keys * stride_vt, lo, hi,
            offs_n, qk_scale, SPLIT=SPLIT, MASK=False, FP32_DOT=FP32_DOT, PRECISION=PRECISION,
        )  # fmt: skip
    for n in range(full_end, length, BLOCK_N):  # the last, partial key tile (a loop of 0 or 1 turns)
        keys = n + offs_n
        rows_in = tl.minimum(keys, length - 1).to(tl.int64)  # keys past the image read its last row, masked out
        acc_lo, acc_hi, m_i, l_i = _attend(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base + rows_in * stride_kt, v_base + rows_in * stride_vt, lo,
            hi, keys < length, qk_scale, SPLIT=SPLIT, MASK=True, FP32_DOT=FP32_DOT, PRECISION=PRECISION,
        )  # fmt: skip
    out_base = out_ptr + rows[:, None] * (H * D) + head * D
    tl.store(out_base + lo[None, :], (acc_lo / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    if SPLIT:
        tl.store(out_base + hi[None, :], (acc_hi / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def head_dim_parts(head_dim: int) -> tuple[int, int] | None:
    """(D_LO, D_HI) with D_LO a power of two and D_HI = head_dim - D_LO zero or a power of two >= 16 (the tensor
    cores' smallest K), or None where the head dim does not split so (e.g. 72: Qwen3-VL)."""
    if head_dim < 16:
        return None
    lo = 1 << (head_dim.bit_length() - 1)
    hi = head_dim - lo
    if hi == 0 or (hi >= 16 and hi & (hi - 1) == 0):
        return lo, hi
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class AttentionConfig(NamedTuple):
    """The kernel's launch: its tiles (BLOCK_M query rows, BLOCK_N keys a step), warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def parse(cls, spec: str) -> AttentionConfig:
        """block_m x block_n x warps x stages, e.g. `128x64x8x3`."""
        return cls(*(int(x) for x in spec.split("x")))

    def __str__(self) -> str:
        return "x".join(str(x) for x in self)


# The compiled kernel's launch: the best of the configurations swept at 896 px and within 5 % of the best at 336 px
# (docs/performance-history.md, "The towers' attention"). One config for every batch, so the tower's warm-up compiles
# the only variant there is (the strides, (heads * head_dim, head_dim), are fixed per tower). The interpreter takes
# small tiles, so the tests cross several key tiles and a partial one per image.
KEY_TILE = 64
QUERY_TILE = 128
_CONFIG = AttentionConfig(QUERY_TILE, KEY_TILE, 8, 3)
_INTERPRET_CONFIG = AttentionConfig(16, 16, 4, 1)
# Launches `benchmarks/tower_bench.py --attention_configs candidates` times against _CONFIG on 4 x 4096 and 16 x 576
# rows (896 and 336 px), to be timed on an H100: a fourth stage; 64-row query tiles (16 x 576 rows fill 5 of 128-row
# tiles to 90 %, 9 of 64 rows wholly), 3 and 4 stages; 256-row tiles on 8 warps (each K/V tile read for twice the
# rows: 80 KiB of shared memory at 2 stages); 4 warps on 128 rows; 32-key steps on 4 warps. (The key loop
# warp-specialized by `tl.range(warp_specialize=True)` compiled for sm_90 to the same PTX, Triton 3.8: not a
# candidate.)
CANDIDATES = tuple(
    AttentionConfig.parse(spec)
    for spec in ("128x64x8x4", "64x64x4x3", "64x64x4x4", "256x64x8x2", "128x64x4x3", "128x32x4x4")
)


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [images + 1] int32, on q's device: image i owns rows cu[i]:cu[i+1]
    max_seqlen: int,  # the longest image (sizes the grid; passed in so that nothing syncs)
    scale: float,
    config: AttentionConfig | None = None,  # None: the tuned one (benchmarks/tower_bench.py times others)
) -> torch.Tensor:  # [T, H, D] contiguous, q's dtype
    """Each image's rows attend to that image's rows (no causal mask), as `varlen_attention_ref`."""
    assert q.dim() == 3 and k.shape == q.shape and v.shape == q.shape, (
        f"q, k, v must be one [tokens, heads, head_dim] shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    )
    assert q.dtype == k.dtype == v.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.is_cuda or _interpreting(), "varlen_attention's Triton kernel needs CUDA tensors"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.stride(-1) == 1, f"{name}: the head dim must be contiguous (stride {t.stride(-1)})"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    assert cu_seqlens.dim() == 1 and cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device, (
        f"cu_seqlens must be 1-D int32 on {q.device}, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)} "
        f"on {cu_seqlens.device}"
    )
    assert scale > 0, f"scale must be positive, got {scale}"  # applied after the row max
    tokens, heads, head_dim = q.shape
    parts = head_dim_parts(head_dim)
    assert parts is not None, f"head_dim {head_dim} is not a power of two plus zero or a power of two >= 16"
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    images = cu_seqlens.shape[0] - 1
    if tokens == 0 or images == 0 or max_seqlen == 0:
        return out
    if config is not None:
        for name, tile in (("block_m", config.block_m), ("block_n", config.block_n)):
            assert tile >= 16 and tile & (tile - 1) == 0, f"{name} must be a power of two >= 16, got {tile}"
    block_m, block_n, warps, stages = config or (_INTERPRET_CONFIG if _interpreting() else _CONFIG)
    grid = (triton.cdiv(max_seqlen, block_m), images, heads)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=heads, D=head_dim, D_LO=parts[0], D_HI=parts[1], BLOCK_M=block_m, BLOCK_N=block_n,
        FP32_DOT=_interpreting() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def varlen_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:  # [T, H, D]
    """The towers' own per-image SDPA path (`sdpa_per_segment`, what they run on CPU), in fp32: the reference the
    kernel is tested against."""
    heads_major = [t.transpose(0, 1).unsqueeze(0).float() for t in (q, k, v)]  # each [1, H, T, D]
    return sdpa_per_segment(*heads_major, cu_seqlens, scale)[0].to(q.dtype)
