"""The gated MLP's activation and multiply in one launch: [gate | up] -> act(gate) * up, with SiLU (Llama, Qwen) or
GELU's tanh approximation (Gemma: HF's gelu_pytorch_tanh, torch's gelu(approximate="tanh"))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    pdl_enter,
    pdl_launch,
)

_BLOCK = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [N, 2I]
    out_ptr,  # [N, I]
    stride_x,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 * g * (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) * (g + 0.044715 g^3): no tanh needed, and it
        # tends to 0 and g (never NaN) where exp over- or underflows.
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # The reference rounds act(gate) to the input dtype before the multiply; do the same.
    act = act.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> silu(gate) * up: [N, I], x's dtype."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> gelu(gate, approximate="tanh") * up: [N, I], x's dtype."""
    return _act_and_mul(x, out, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    device = check_device(x=x)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    assert x.shape[1] % 2 == 0, f"x: last dimension {x.shape[1]} must be even ([gate | up])"
    check_inner_contiguous("x", x)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=x.dtype, device=device)
    check_out(out, (num_rows, inter), x.dtype, device)
    if num_rows == 0 or inter == 0:
        return out
    grid = (num_rows, cdiv(inter, _BLOCK))
    _act_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK, GELU_TANH=gelu_tanh, num_warps=4,
        **pdl_launch(device),
    )  # fmt: skip
    return out
