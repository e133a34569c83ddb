"""Packed (variable-length) attention for the Qwen-VL vision towers: every image of a batch in one token sequence,
kept apart by cumulative patch counts (cu_seqlens), run by one varlen flash kernel; no padding, no per-image loop.
`visual/models/fused_layers.py` calls it from each block; this file holds the kernel call and the packed index.

The kernel is `torch.nn.attention.varlen.varlen_attn` (flash, CUDA, fp16/bf16). Its keyword arguments changed across
torch releases (2.9 has `is_causal`, later ones `scale`/`window_size`), so it is called by what its signature offers.
Where it cannot run (CPU, fp32, an older torch) each image goes through SDPA in turn: exactly transformers' sdpa
path.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256

VarlenFn = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


def torch_varlen_attn() -> VarlenFn | None:
    """torch's varlen flash attention, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _parameters(fn: VarlenFn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def can_use_varlen(query: torch.Tensor, kernel: VarlenFn | None) -> bool:
    """The flash varlen kernel runs on CUDA, in half precision, for head dims that are multiples of 8 up to 256."""
    head_dim = query.shape[-1]
    return (
        kernel is not None
        and query.is_cuda
        and query.dtype in _VARLEN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= _VARLEN_MAX_HEAD_DIM
    )


def call_varlen(
    kernel: VarlenFn,
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key: torch.Tensor,  # [tokens, heads, head_dim]
    value: torch.Tensor,  # [tokens, heads, head_dim]
    cu_seqlens: torch.Tensor,  # [segments + 1] int32, on the tensors' device
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:  # [tokens, heads, head_dim]
    """One non-causal varlen call, with the arguments this torch's `varlen_attn` signature takes."""
    params = _parameters(kernel)
    kwargs: dict = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, query.shape[-1] ** -0.5):
        # No scale argument: the kernel uses 1/sqrt(head_dim); fold the difference into the queries.
        query = query * (scale * math.sqrt(query.shape[-1]))
    if "is_causal" in params:
        kwargs["is_causal"] = False
    out = kernel(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) where an aux output was asked for


# For a batch whose images (or windows) all have one length: flash, not cuDNN. cuDNN's kernel is faster once it runs,
# but it builds a plan, tens to hundreds of ms, the first time it meets each (batch, length) shape. A server meets new
# shapes all the time (every image size, every batch size up to the encoder's limit), and each build stalls every
# image queued behind it. Flash builds nothing.
_DENSE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def dense_attention(
    query: torch.Tensor,  # [segments * length, heads, head_dim]: segments of one length, packed
    key: torch.Tensor,
    value: torch.Tensor,
    segments: int,
    scale: float,
) -> torch.Tensor:  # [segments * length, heads, head_dim]
    """Packed segments of equal length attended as one dense batch (each segment to itself)."""
    tokens, heads, head_dim = query.shape
    assert tokens % segments == 0, f"{tokens} tokens do not split into {segments} equal segments"

    def batched(t: torch.Tensor) -> torch.Tensor:  # [segments, heads, length, head_dim] view
        return t.view(segments, tokens // segments, heads, head_dim).transpose(1, 2)

    backends = _DENSE_BACKENDS if query.is_cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends, set_priority=True):
        out = F.scaled_dot_product_attention(batched(query), batched(key), batched(value), scale=scale)
    return out.transpose(1, 2).reshape(tokens, heads, head_dim)


def sdpa_per_segment(
    query: torch.Tensor,  # [1, heads, tokens, head_dim]
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # [segments + 1]
    scale: float,
) -> torch.Tensor:  # [1, tokens, heads, head_dim]
    """The fallback: each segment through SDPA in turn, as transformers' sdpa path does it (same kernel, same inputs,
    so the same numbers)."""
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scale=scale)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]  # each [1, heads, length, head_dim]
    return torch.cat(outs, dim=2).transpose(1, 2)


# ------------------------------------------------------------------------------------------------ packed inputs


@dataclass(frozen=True)
class PackedIndex:
    """What the tower derives from the image grids, built on the host once per batch so that the device does no
    per-image work and nothing syncs: passed to the tower as its `cu_seqlens`, `max_seqlen`, `position_ids`
    keyword arguments (transformers uses them instead of computing its own)."""

    cu_seqlens: torch.Tensor  # [frames + 1] int32: start of each frame's patches (each frame attends to itself)
    max_seqlen: int  # patches of the largest frame
    position_ids: torch.Tensor  # [patches, 2] long: (row, col) of each patch, in the tower's 2x2-block order


def pack_index(grids: Sequence[tuple[int, int, int]], merge_size: int) -> PackedIndex:
    """cu_seqlens and rotary position ids of a batch of (t, h, w) patch grids, on CPU."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), dim=0, out=cu[1:])
    positions = torch.cat([_grid_positions(t, h, w, merge_size) for t, h, w in grids])
    return PackedIndex(cu, max(lengths), positions)


@functools.lru_cache(maxsize=256)
def _grid_positions(t: int, h: int, w: int, merge_size: int) -> torch.Tensor:  # [t*h*w, 2]
    """(row, col) of each patch of one image, ordered as the processor emits patches: 2x2 merge blocks row-major,
    the patches inside a block row-major. Cached: under load most images share a few grid sizes."""
    rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
    cols = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: block-major order
    block = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
    return block.repeat(t, 1)
