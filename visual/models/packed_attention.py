"""Packed (variable-length) attention for Qwen2-VL's vision tower: every image of a batch in one token sequence, kept
apart by cumulative patch counts (cu_seqlens), run by one varlen flash kernel; no padding, no per-image loop.

transformers keeps the tower's blocks; only its attention function is ours. Its `VisionAttention` dispatches on the
config's `_attn_implementation` (transformers 5.17 .. 5.23 alike):
- a name containing "flash" gets ONE call for the whole batch, with `cu_seq_lens_q/k` and `max_length_q/k`;
- any other name (eager, sdpa) gets one call per image (a Python loop with a `.tolist()` host sync per layer).
So we register our function under a name containing "flash" and set it on the tower's config directly (the public
`set_attn_implementation` would try to load a flash kernel from the hub for such a name).

The kernel is `torch.nn.attention.varlen.varlen_attn` (flash, CUDA, fp16/bf16). Its keyword arguments changed across
torch releases (2.9 has `is_causal`, later ones `scale`/`window_size`), so it is called by what its signature offers.
Where it cannot run (CPU, fp32, an older torch) each image goes through SDPA in turn: exactly HF's sdpa path.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "mmserve_flash_varlen"  # "flash" in the name selects transformers' packed branch
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


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim]: every image of the batch, packed
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,  # [segments + 1]
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, tokens, heads, head_dim], no weights)
    """transformers' attention-function interface (as its flash-attention forward is called by VisionAttention)."""
    if attention_mask is not None or is_causal or dropout:
        raise ValueError("packed vision attention is full (non-causal, unmasked) attention, without dropout")
    if cu_seq_lens_q is None:  # called outside the packed branch: the whole input is one sequence
        cu_seq_lens_q = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
    same_k = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q  # transformers passes one tensor for both
    if not same_k and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("packed vision attention is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernel = torch_varlen_attn()
    if not can_use_varlen(query, kernel):
        return sdpa_per_segment(query, key, value, cu_seq_lens_q, scale), None
    if max_length_q is None:  # transformers passes it; computing it here costs a host sync
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    q, k, v = (_tokens_major(t) for t in (query, key, value))  # each [tokens, heads, head_dim]
    out = call_varlen(kernel, q, k, v, cu_seq_lens_q.to(torch.int32), max_length_q, scale)
    return out.unsqueeze(0), None


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, head_dim] -> [tokens, heads, head_dim]; VisionAttention built it by transposing exactly
    this layout, so q and k come back as contiguous views. v is a strided slice of the fused qkv output: copied,
    since the varlen kernel's stride requirements differ across torch builds (a copy costs ~0.1 ms per block)."""
    t = t[0].transpose(0, 1)
    return t if t.is_contiguous() else t.contiguous()


def use_packed_attention(tower: torch.nn.Module) -> None:
    """Route the attention of every block of a Qwen2-VL vision tower to `packed_attention_forward`."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    configs = {id(m.config): m.config for m in tower.modules() if hasattr(m, "config")}
    for config in configs.values():  # the blocks share the tower's config object; set every one there is anyway
        config._attn_implementation = ATTN_IMPLEMENTATION


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
