"""QuickGELU, x * sigmoid(1.702 x), the activation of Qwen2-VL's vision MLP, in one kernel (transformers runs it as
three: a scale, a sigmoid and a multiply, each reading and writing the [tokens, 5120] activations)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BLOCK = 2048


# numel stays specialized (divisible by 16 or not): with it unknown the masked loads and stores are not vectorized,
# and the kernel ran at half the memory bandwidth. Tower activations are [tokens, 4 * width]: always divisible.
@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    # Rounded to the input dtype after each step, as transformers' three kernels round it.
    scaled = (x.to(tl.float32) * 1.702).to(dtype).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, (x.to(tl.float32) * gate).to(dtype), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x: any shape, contiguous -> x * sigmoid(1.702 x), same shape and dtype."""
    assert x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1", "quick_gelu's Triton kernel needs CUDA tensors"
    assert x.is_contiguous(), f"x must be contiguous (strides {x.stride()})"
    out = torch.empty_like(x)
    if x.numel():
        _quick_gelu_kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, out, x.numel(), BLOCK=_BLOCK, num_warps=8)
    return out


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation."""
    return x * torch.sigmoid(1.702 * x)
