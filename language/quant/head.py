"""The LM head in FP8, when the server quantizes the decoder at load (`--quant_type fp8w8a8`).

At batch 1 the head is the largest single read of a decode step (Qwen2-VL-7B: 152064 x 3584, 1.09 GB in bf16, about
9 % of the FP8 step on an H100); in e4m3 it reads half the bytes, through the same per-channel arithmetic and paths
as the decoder's linears (language/quant/fp8.py: the fused GEMV at one row, the weight-streaming GEMM at 2-64 rows,
cuBLASLt's row-wise scaled GEMM at more). Each vocabulary row gets its own scale, so a row's logit carries only its
own rounding, and the per-token activation scale is the same on every tensor-parallel rank (each holds whole dot
products over the hidden size): tp=N's logits are tp=1's.

A tied head (tie_word_embeddings) gets its own e4m3 copy; the embedding stays in the model's dtype, since a lookup
reads one row a token and gains nothing from 8 bits. Published FP8 checkpoints keep their head as published."""

from __future__ import annotations

import torch
from torch import nn

from language.parallel.group import TPGroup
from language.parallel.layers import ParallelLMHead, gather_vocab
from language.quant.fp8 import quantize_weight
from language.quant.linear import Fp8Linear
from language.quant.scheme import PER_CHANNEL_AT_LOAD

_ROWS_PER_STEP = 8192  # vocabulary rows quantized at a time: a 7B head's fp32 temporaries stay ~120 MB, not 2 GB


class Fp8LMHead(Fp8Linear):
    """ParallelLMHead with e4m3 rows and a scale per row: hidden [n, H] -> logits [n, vocab] in the hidden's dtype
    on every rank (this rank's vocabulary rows scored, then gathered)."""

    def __init__(self, hidden: int, rows: int, vocab: int, tp: TPGroup) -> None:
        super().__init__(hidden, rows, PER_CHANNEL_AT_LOAD)  # no row-parallel group: each logit is a whole sum
        self.vocab, self.vocab_tp = vocab, tp

    @classmethod
    def quantized(cls, head: ParallelLMHead) -> Fp8LMHead:
        """The FP8 copy of `head`'s weight (this rank's rows, padding included), on its device."""
        weight = head.weight.detach()
        with torch.device(weight.device):
            fp8 = cls(head.in_features, head.out_features, head.vocab, head.tp)
        for start in range(0, weight.shape[0], _ROWS_PER_STEP):
            rows = slice(start, start + _ROWS_PER_STEP)
            q, scales = quantize_weight(weight[rows])
            fp8.weight.data[rows].copy_(q)
            fp8.weight_scale.data[rows].copy_(scales)
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(super().forward(x), self.vocab, self.vocab_tp)


def quantize_lm_head(model: nn.Module) -> None:
    """Replace the model's LM head by its FP8 copy, in place; an untied head's bf16 weight is dropped with it."""
    model.lm_head = Fp8LMHead.quantized(model.lm_head)
