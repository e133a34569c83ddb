"""Which part of the decoder one rank holds, and the slice of each checkpoint tensor it reads for it.

Megatron's split: q/k/v and gate/up are column-parallel (by heads, by columns of the MLP), o and down are
row-parallel (their outputs are summed over ranks), the embedding and lm_head are split by vocabulary rows. KV
heads are split when there are at least as many as ranks; otherwise each rank keeps the one KV head its query
heads read (replicated over tp / num_kv_heads ranks). Norms are replicated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from language.config import LMConfig

_COLUMN = ("qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


class TensorView(Protocol):
    """A checkpoint tensor not read yet (safetensors' slice), or a tensor: indexing reads only what it names."""

    def __getitem__(self, index) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """This rank's part of each sharded dimension (sizes, and where they start in the full model)."""

    rank: int
    size: int
    heads: int  # query heads of this rank
    head0: int
    kv_heads: int  # KV heads of this rank (1 when they are replicated)
    kv_head0: int
    intermediate: int
    inter0: int
    vocab: int  # vocabulary rows per rank (the last rank's may run past the real vocabulary: zero padding)
    vocab0: int
    full: LMConfig

    @property
    def vocab_rows(self) -> int:
        """Real vocabulary rows of this rank (the rest of its `vocab` rows are padding)."""
        return max(0, min(self.vocab, self.full.vocab_size - self.vocab0))


def make_shard(cfg: LMConfig, rank: int = 0, size: int = 1) -> Shard:
    """This rank's shard; a tp that cannot split the model raises ValueError saying why."""
    check_divisible(cfg, size)
    heads, kv = cfg.num_heads // size, cfg.num_kv_heads
    if kv >= size:
        kv_heads, kv_head0 = kv // size, rank * (kv // size)
    else:  # each rank's query heads fall in one KV group: keep that group's KV head
        kv_heads, kv_head0 = 1, rank * kv // size
    inter = cfg.intermediate_size // size
    vocab = -(-cfg.vocab_size // size)
    return Shard(rank, size, heads, rank * heads, kv_heads, kv_head0, inter, rank * inter, vocab, rank * vocab, cfg)


def check_divisible(cfg: LMConfig, size: int) -> None:
    if size < 1:
        raise ValueError("--tp must be >= 1")
    h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % size:
        raise ValueError(
            f"--tp {size} does not divide the model's {h} attention heads; use a tp that divides {h} "
            f"(one of {[d for d in range(1, h + 1) if h % d == 0]})"
        )
    if kv >= size and kv % size:
        raise ValueError(f"--tp {size} does not divide the model's {kv} KV heads; use a tp that divides {kv}")
    if kv < size and size % kv:
        raise ValueError(f"--tp {size} is not a multiple of the model's {kv} KV heads (needed to replicate them)")
    if inter % size:
        raise ValueError(f"--tp {size} does not divide the model's MLP width {inter}")


def take(shard: Shard, module: str, piece: int | None, view: TensorView) -> torch.Tensor:
    """This rank's slice of one checkpoint tensor. `module`: our module name (qkv_proj, o_proj, ...); `piece`: which
    part of a fused parameter the tensor is (q=0, k=1, v=2; gate=0, up=1), None for the whole fused tensor."""
    if shard.size == 1 or module not in _COLUMN + _ROW + _VOCAB:
        return view[:]
    if module in _ROW:  # weight [out, in]: this rank's input columns
        return view[:, _row_range(shard, module)]
    if module in _VOCAB:
        return view[shard.vocab0 : shard.vocab0 + shard.vocab_rows]
    pieces = _pieces(shard, module)
    if piece is not None:
        return view[pieces[piece][0]]
    # A checkpoint that stores the fused tensor (QWen's c_attn): each piece's rows, moved to where the piece starts.
    return torch.cat([view[rows.start + base : rows.stop + base] for rows, base in pieces])


def _row_range(shard: Shard, module: str) -> slice:
    if module == "o_proj":
        d = shard.full.head_dim
        return slice(shard.head0 * d, (shard.head0 + shard.heads) * d)
    return slice(shard.inter0, shard.inter0 + shard.intermediate)


def _pieces(shard: Shard, module: str) -> list[tuple[slice, int]]:
    """Per piece: (the rows this rank takes of the piece's own tensor, where the piece starts in the fused one)."""
    c = shard.full
    if module == "gate_up_proj":
        rows = slice(shard.inter0, shard.inter0 + shard.intermediate)
        return [(rows, 0), (rows, c.intermediate_size)]
    d, q_size, kv_size = c.head_dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q = slice(shard.head0 * d, (shard.head0 + shard.heads) * d)
    kv = slice(shard.kv_head0 * d, (shard.kv_head0 + shard.kv_heads) * d)
    return [(q, 0), (kv, q_size), (kv, q_size + kv_size)]
