"""Layers whose output needs the other ranks: a row-parallel linear (partial sums all-reduced), the embedding and
lm_head split by vocabulary rows. With a group of one they are the plain layers, with no collective at all.
Column-parallel linears (q/k/v, gate/up) need no communication: they are nn.Linear of this rank's width."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from language.parallel.group import TPGroup


class RowParallelLinear(nn.Linear):
    """x [n, in / tp] (this rank's columns) -> [n, out], summed over ranks. No bias (o_proj and down_proj have
    none; a bias would be added once, not once per rank)."""

    def __init__(self, in_local: int, out_features: int, tp: TPGroup):
        super().__init__(in_local, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab0, vocab0 + rows) of the table on each rank; ids outside them look up zeros, and the sum over
    ranks is the full lookup."""

    def __init__(self, rows: int, hidden: int, vocab0: int, tp: TPGroup):
        super().__init__(rows, hidden)
        self.vocab0, self.tp = vocab0, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(ids)
        local = ids - self.vocab0  # [n]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [n, hidden]
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Linear):
    """hidden [n, H] -> logits [n, vocab] on every rank: each rank scores its vocabulary rows, then an all-gather
    (so every rank can take the greedy argmax itself; rank 0 samples)."""

    def __init__(self, hidden: int, rows: int, vocab: int, tp: TPGroup):
        super().__init__(hidden, rows, bias=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # [n, rows]
        if not self.tp.enabled:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.vocab]  # padding rows of the last rank dropped
