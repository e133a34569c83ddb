"""Rotary embedding: the cos/sin tables (plain RoPE, Qwen2-VL's M-RoPE and Qwen3-VL's interleaved M-RoPE) and their
neox-style application."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_out,
    check_shape,
    interpreting,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)

_BLOCK_TOKENS = 32


# Token counts and the strides that follow them are not specialized (Triton would compile a variant for 1, for
# multiples of 16 and for the rest): decode-graph capture at start-up meets all three.
@triton.jit(do_not_specialize=["stride_pos_axis", "num_tokens"])
def _cos_sin_kernel(
    pos_ptr,  # [A, N] positions per axis (A = 1 for RoPE, 3 for M-RoPE)
    inv_freq_ptr,  # [F]
    cos_ptr,  # [N, F] fp32
    sin_ptr,  # [N, F] fp32
    stride_pos_axis,
    num_tokens,
    num_freqs,
    axis1_start,  # first band that follows axis 1 (== num_freqs when there is one axis); interleaved: its end
    axis2_start,  # first band that follows axis 2; interleaved: its end
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # compiled: CUDA's full-range cosf/sinf (angles reach thousands of radians)
    USE_PDL: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,  # bands cycle t, h, w (f % 3) below each axis's end, then t
):
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, BLOCK_F)
    mask = (offs_n < num_tokens)[:, None] & (offs_f < num_freqs)[None, :]
    if INTERLEAVED:
        phase = offs_f % 3
        axis = ((phase == 1) & (offs_f < axis1_start)).to(tl.int32) + 2 * ((phase == 2) & (offs_f < axis2_start)).to(
            tl.int32
        )  # [F]
    else:
        axis = (offs_f >= axis1_start).to(tl.int32) + (offs_f >= axis2_start).to(tl.int32)  # [F]
    pos = tl.load(pos_ptr + axis[None, :] * stride_pos_axis + offs_n[:, None], mask=mask, other=0)
    inv_freq = tl.load(inv_freq_ptr + offs_f, mask=offs_f < num_freqs, other=0.0).to(tl.float32)
    freqs = pos.to(tl.float32) * inv_freq[None, :]  # [BLOCK_N, BLOCK_F]
    offs = offs_n[:, None] * num_freqs + offs_f[None, :]
    if LIBDEVICE:
        cos, sin = libdevice.cos(freqs), libdevice.sin(freqs)
    else:  # the interpreter has no libdevice; its tl.cos is numpy's
        cos, sin = tl.cos(freqs), tl.sin(freqs)
    tl.store(cos_ptr + offs, cos, mask=mask)
    tl.store(sin_ptr + offs, sin, mask=mask)


def _cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    boundaries: tuple[int, int],
    out: tuple[torch.Tensor, ...] | None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [A, N] -> cos, sin: [N, F] fp32; band f follows axis (f >= boundaries[0]) + (f >= boundaries[1]),
    or, interleaved, axis 1 if f % 3 == 1 and f < boundaries[0], axis 2 if f % 3 == 2 and f < boundaries[1], else 0."""
    device = check_device(positions=positions, inv_freq=inv_freq)
    check_dtype("positions", positions, INDEX_DTYPES)
    check_dtype("inv_freq", inv_freq, FLOAT_DTYPES)
    check_shape("inv_freq", inv_freq, (None,))
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    num_tokens, num_freqs = positions.shape[1], inv_freq.shape[0]
    if out is None:
        out = tuple(torch.empty((num_tokens, num_freqs), dtype=torch.float32, device=device) for _ in range(2))
    assert len(out) == 2, "out: expected a (cos, sin) pair"
    for table in out:
        check_out(table, (num_tokens, num_freqs), torch.float32, device)
    if num_tokens > 0:
        grid = (cdiv(num_tokens, _BLOCK_TOKENS),)
        _cos_sin_kernel[grid](
            positions, inv_freq, out[0], out[1], positions.stride(0), num_tokens, num_freqs, *boundaries,
            BLOCK_N=_BLOCK_TOKENS, BLOCK_F=pow2_at_least(num_freqs, 16), LIBDEVICE=not interpreting(),
            INTERLEAVED=interleaved, num_warps=4, **pdl_launch(device),
        )  # fmt: skip
    return out[0], out[1]


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] -> cos, sin: [N, D/2] in fp32."""
    check_shape("positions", positions, (None,))
    num_freqs = inv_freq.shape[0]
    return _cos_sin(positions[None, :], inv_freq, (num_freqs, num_freqs), out)


def mrope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: list[int],
    interleaved: bool = False,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [3, N] (temporal, height, width) -> cos, sin: [N, D/2]. Qwen2-VL's M-RoPE: the j-th chunk of
    `mrope_section` bands takes its angle from axis j. Interleaved (Qwen3-VL): band f follows height if f % 3 == 1
    and f < 3 * section[1], width if f % 3 == 2 and f < 3 * section[2], else the temporal axis."""
    check_shape("positions", positions, (3, None))
    assert len(mrope_section) == 3, f"mrope_section: expected 3 chunks, got {mrope_section}"
    assert sum(mrope_section) == inv_freq.shape[0], (
        f"mrope_section {mrope_section} must cover the {inv_freq.shape[0]} frequency bands"
    )
    if interleaved:
        boundaries = (3 * mrope_section[1], 3 * mrope_section[2])
    else:
        boundaries = (mrope_section[0], mrope_section[0] + mrope_section[1])
    return _cos_sin(positions, inv_freq, boundaries, out, interleaved)


@triton.jit
def _apply_rotary_kernel(
    x_ptr,  # [N, H, D]
    cos_ptr,  # [N, D/2]
    sin_ptr,  # [N, D/2]
    out_ptr,  # [N, H, D] contiguous
    stride_xn,
    stride_xh,
    stride_cos,
    stride_sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_f = tl.arange(0, BLOCK_HALF)
    f_mask = offs_f < HALF
    mask = (offs_h < num_heads)[:, None] & f_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    # The reference casts cos/sin to x's dtype and rounds after each product and the sum; mirror that.
    cos = tl.load(cos_ptr + token * stride_cos + offs_f, mask=f_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + offs_f, mask=f_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    x_row = x_ptr + token * stride_xn + offs_h[:, None] * stride_xh + offs_f[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out_row = out_ptr + token * num_heads * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_f[None, :]
    tl.store(out_row, out1.to(dtype), mask=mask)
    tl.store(out_row + HALF, out2.to(dtype), mask=mask)


def check_rotary(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.device:
    """apply_rotary's operands (see there), checked; also rotary_store_kv's q and k, under `name`. Returns the
    device."""
    device = check_device(**{name: x}, cos=cos, sin=sin)
    check_dtype(name, x, FLOAT_DTYPES)
    check_dtype("cos", cos, FLOAT_DTYPES)
    check_dtype("sin", sin, FLOAT_DTYPES)
    check_shape(name, x, (None, None, None))
    num_tokens, _, head_dim = x.shape
    assert head_dim % 2 == 0, f"{name}: head dim {head_dim} must be even"
    check_shape("cos", cos, (num_tokens, head_dim // 2))
    check_shape("sin", sin, (num_tokens, head_dim // 2))
    for label, t in ((name, x), ("cos", cos), ("sin", sin)):
        check_inner_contiguous(label, t)
    return device


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [N, H, D] (any token/head strides, e.g. a view into a fused qkv), cos/sin: [N, D/2] -> a new rotated
    tensor [N, H, D] in x's dtype (rotate-half style). x itself is left untouched."""
    device = check_rotary("x", x, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=device)
    check_out(out, (num_tokens, num_heads, head_dim), x.dtype, device)
    if num_tokens == 0 or num_heads == 0:
        return out
    block_h = min(pow2_at_least(num_heads), 16)
    grid = (num_tokens, cdiv(num_heads, block_h))
    _apply_rotary_kernel[grid](
        x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), num_heads,
        HALF=head_dim // 2, BLOCK_H=block_h, BLOCK_HALF=pow2_at_least(head_dim // 2, 16), num_warps=4,
        enable_fp_fusion=False,  # fp32: a fused multiply-add would round the product and the sum once, not twice
        **pdl_launch(device),
    )  # fmt: skip
    return out
