"""Triton kernels of the vision towers, each with its torch reference: the kernel runs on CUDA tensors, the reference
elsewhere (CPU serving and tests; tests also run the kernels under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from visual.kernels.add_layer_norm import add_layer_norm as _add_layer_norm_triton
from visual.kernels.add_layer_norm import add_layer_norm_ref
from visual.kernels.qkv_rotary import qkv_rotary as _qkv_rotary_triton
from visual.kernels.qkv_rotary import qkv_rotary_ref
from visual.kernels.quick_gelu import quick_gelu as _quick_gelu_triton
from visual.kernels.quick_gelu import quick_gelu_ref
from visual.kernels.varlen_attention import varlen_attention, varlen_attention_ref


def add_layer_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] x, y -> h = x + y and LayerNorm(h), each [rows, width]."""
    fused = x.is_cuda and x.stride(-1) == 1 and y.stride(-1) == 1
    return (_add_layer_norm_triton if fused else add_layer_norm_ref)(x, y, weight, bias, eps)


def qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, 3*H*D] -> q, k (2-D rotary applied), v: each [N, H, D] contiguous."""
    fn = _qkv_rotary_triton if qkv.is_cuda else qkv_rotary_ref
    return fn(qkv, cos, sin, num_heads)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return _quick_gelu_triton(x) if x.is_cuda and x.is_contiguous() else quick_gelu_ref(x)


__all__ = [
    "add_layer_norm",
    "add_layer_norm_ref",
    "qkv_rotary",
    "qkv_rotary_ref",
    "quick_gelu",
    "quick_gelu_ref",
    "varlen_attention",
    "varlen_attention_ref",
]
