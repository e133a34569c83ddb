"""The vision towers' attention input in one pass: the fused qkv projection's output split into q, k and v, with the
2-D rotary applied to q and k.

transformers' `apply_rotary_pos_emb_vision` upcasts q and k to fp32, builds rotate_half with a cat and a neg, and
casts back: about ten elementwise kernels per block, a quarter of a 7B-shaped tower's GPU time at 896 px. Here it is
one kernel that reads qkv once and writes q, k, v as contiguous [tokens, heads, head_dim] (what the varlen attention
takes), with the same fp32 arithmetic.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BLOCK_TOKENS = 16


# The row strides stay specialized (divisible by 16 or not): with them unknown, rows could not be read and written
# as vectors. They are fixed per tower (3 * width, head_dim), so this costs no extra compiles; the token count varies
# with every batch and is not specialized.
@triton.jit(do_not_specialize=["num_tokens"])
def _qkv_rotary_kernel(
    qkv_ptr,  # [N, 3 * H * D]: q heads, then k heads, then v heads
    cos_ptr,  # [N, >= D/2] (row stride stride_cos): the first D/2 columns are read
    sin_ptr,
    out_ptr,  # [3, N, H, D] contiguous: q, k (rotated), v
    num_tokens,
    stride_qkv,
    stride_cos,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= D / 2
):
    HALF: tl.constexpr = D // 2
    head = tl.program_id(1)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_t < num_tokens)[:, None] & (offs_d < HALF)[None, :]
    cos = tl.load(cos_ptr + offs_t[:, None] * stride_cos + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + offs_t[:, None] * stride_cos + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    row_in = qkv_ptr + offs_t[:, None] * stride_qkv + offs_d[None, :]  # [BLOCK_T, BLOCK_HALF]
    row_out = out_ptr + (offs_t[:, None] * H + head) * D + offs_d[None, :]
    plane = num_tokens * H * D  # elements of each of q, k, v in out
    for part in tl.static_range(3):
        src = row_in + (part * H + head) * D
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        dst = row_out + part * plane
        if part < 2:  # q and k: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32 as transformers does it
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
            tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # v: copied as it is
            tl.store(dst, x1, mask=mask)
            tl.store(dst + HALF, x2, mask=mask)


def qkv_rotary(
    qkv: torch.Tensor,  # [N, 3 * H * D]
    cos: torch.Tensor,  # [N, D] (both halves equal, as the towers build it) or [N, D/2]
    sin: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v: each [N, H, D] contiguous, qkv's dtype
    num_tokens, width = _check(qkv, cos, sin, num_heads)
    head_dim = width // (3 * num_heads)
    assert qkv.is_cuda or os.environ.get("TRITON_INTERPRET") == "1", "qkv_rotary's Triton kernel needs CUDA tensors"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1, "rows must be contiguous"
    assert cos.stride(0) == sin.stride(0), "cos and sin must share a row stride"
    out = torch.empty((3, num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, _BLOCK_TOKENS), num_heads)
        _qkv_rotary_kernel[grid](
            qkv, cos, sin, out, num_tokens, qkv.stride(0), cos.stride(0),
            H=num_heads, D=head_dim, BLOCK_T=_BLOCK_TOKENS, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )  # fmt: skip
    return out[0], out[1], out[2]


def qkv_rotary_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' arithmetic (apply_rotary_pos_emb_vision), term for term: equal to it bit for bit."""
    num_tokens, width = _check(qkv, cos, sin, num_heads)
    q, k, v = qkv.view(num_tokens, 3, num_heads, width // (3 * num_heads)).unbind(1)  # each [N, H, D]
    half = q.shape[-1] // 2
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()  # [N, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().split(half, dim=-1)
        return torch.cat([x1 * c + (-x2) * s, x2 * c + x1 * s], dim=-1).to(qkv.dtype)

    return rotate(q), rotate(k), v.contiguous()


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> tuple[int, int]:
    assert qkv.dim() == 2 and qkv.shape[1] % (3 * num_heads) == 0, (
        f"qkv: shape {tuple(qkv.shape)} is not [tokens, 3 * {num_heads} heads * head_dim]"
    )
    num_tokens, width = qkv.shape
    half = width // (3 * num_heads) // 2
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.dim() == 2 and t.shape[0] == num_tokens and t.shape[1] >= half, (
            f"{name}: shape {tuple(t.shape)}, expected [{num_tokens}, >= {half}]"
        )
        assert t.device == qkv.device, f"{name} on {t.device}, qkv on {qkv.device}"
    return num_tokens, width
