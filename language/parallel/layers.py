"""Layers whose output needs the other ranks: a row-parallel linear (partial sums all-reduced), the embedding and
lm_head split by vocabulary rows. With a group of one they are the plain layers, with no collective at all.
Column-parallel linears (q/k/v, gate/up) need no communication: they are `Linear` of this rank's width. Every
layer here multiplies through `kernels.linear` (on CUDA: a GEMV kernel for one row, a weight-streaming GEMM for 2
to 64 rows, cuBLAS above; F.linear off CUDA).

Each is built to round where the unsharded layer rounds and nowhere else, so that TP=N differs from TP=1 only by
the order of fp32 sums: the row-parallel partials are summed in fp32 and rounded once; the embedding's sum adds
zeros (exact); lm_head's gather only moves each rank's logits, which are whole dot products over the hidden size."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from language import kernels
from language.parallel.group import TPGroup

# torch >= 2.8 on CUDA: a bf16/fp16 GEMM that writes its fp32 accumulator instead of rounding it (aten::mm.dtype).
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, k] @ weight[m, k].T -> [n, m] in fp32, unrounded: the sum the unsharded layer's GEMM accumulates in
    fp32 before its one rounding to the model's dtype. Products of two bf16 (or fp16) values are exact in fp32, so
    the upcast fallback (CPU; CUDA before torch 2.8, at an extra pass over the weight) computes the same sum."""
    if x.dtype == torch.float32:
        return F.linear(x, weight)
    if kernels.gemv_applies(x, weight):
        return kernels.gemv(x, weight, out_dtype=torch.float32)
    if kernels.skinny_applies(x, weight):
        return kernels.skinny_gemm(x, weight, out_dtype=torch.float32)
    if x.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


class Linear(nn.Linear):
    """nn.Linear through `kernels.linear` (same parameters and names)."""

    def input_form(self, rows: int) -> kernels.InputForm:
        """The form the layer takes `rows` rows of input in (an FP8 linear's, language/quant/linear.py); a layer in
        the model's dtype takes the rows as they are."""
        return kernels.InputForm.PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """x [n, in / tp] (this rank's columns) -> [n, out], summed over ranks. No bias (o_proj and down_proj have
    none; a bias would be added once, not once per rank).

    Each rank's partial product stays in fp32 through the all-reduce and is rounded to the model's dtype once,
    after it, as TP=1's GEMM rounds its full sum once. Reducing bf16 partials instead rounds each of them and the
    sum again: about a third of the outputs then miss TP=1's value by an ulp, enough to flip greedy near-ties.
    The cost is the all-reduce's bytes, doubled: [n, hidden] fp32 instead of bf16 (decode: 14 KiB at batch 1 for
    a 7B, latency-bound either way; a 4096-token prefill chunk: 56 MiB instead of 28 per all-reduce)."""

    def __init__(self, in_local: int, out_features: int, tp: TPGroup):
        super().__init__(in_local, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(x)
        partial = linear_fp32(x.reshape(-1, x.shape[-1]), self.weight)  # [n, out] fp32: this rank's columns' sum
        out = self.tp.all_reduce(partial).to(x.dtype)  # one rounding, as TP=1's GEMM
        return out.view(*x.shape[:-1], out.shape[-1])


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


class ParallelLMHead(Linear):
    """hidden [n, H] -> logits [n, vocab] on every rank: each rank scores its vocabulary rows, then an all-gather
    (so every rank can take the greedy argmax itself; rank 0 samples)."""

    def __init__(self, hidden: int, rows: int, vocab: int, tp: TPGroup):
        super().__init__(hidden, rows, bias=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(super().forward(x), self.vocab, self.tp)


def gather_vocab(logits: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    """Each rank's logits of its vocabulary rows [n, rows] -> [n, vocab], the same on every rank."""
    if not tp.enabled:
        return logits
    return tp.all_gather_last(logits)[:, :vocab]  # padding rows of the last rank dropped
