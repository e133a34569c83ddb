"""`--vit_quant_type fp8w8a8`: the vision tower's encoder-layer linears (attention q/k/v and output, MLP) in FP8
e4m3, weights per output channel quantized at load and activations per token, through the language model's FP8
arithmetic (language/quant/fp8.py: cuBLASLt's row-wise scaled GEMM on CUDA, a torch reference of the same arithmetic
elsewhere). The patch embedding, position tables, norms and the merger / projector stay in the tower's dtype."""

from __future__ import annotations

import re

import torch
from torch import nn

from language.quant.fp8 import fp8_linear, quantize_weight

# An encoder layer's modules, under every tower's naming (Qwen-VL's blocks.N, CLIP's and InternViT's layers.N)
_ENCODER_LAYER = re.compile(r"(^|\.)(blocks|layers)\.\d+\.")


class Fp8TowerLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scales = quantize_weight(linear.weight.detach())
        self.weight = nn.Parameter(q, requires_grad=False)  # [N, K] e4m3
        self.weight_scale = nn.Parameter(scales, requires_grad=False)  # [N, 1] fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_tower(tower: nn.Module) -> int:
    """Swap every nn.Linear inside the tower's encoder layers for an Fp8TowerLinear, in place (after the weights are
    loaded and our fused layers swapped in: they hold the same Linear modules). Returns how many were swapped."""
    targets = [name for name, m in tower.named_modules() if type(m) is nn.Linear and _ENCODER_LAYER.search(name)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = tower.get_submodule(parent_name)
        setattr(parent, child, Fp8TowerLinear(getattr(parent, child)))
    return len(targets)
