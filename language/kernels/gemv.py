"""One row times a weight matrix: the linear layers of a batch-1 decode step, which only stream their weights.

cuBLAS reads a 7B layer's weights at 2.2-2.9 TB/s on an H100 for one row (its small-GEMM tiles, and a split-K
reduce plus a memset for down_proj); this kernel reads them at up to 3.05 TB/s, 6-12 % faster per layer
(`python benchmarks/kernels_bench.py --only gemv`; docs/performance-history.md). Each program owns
BLOCK_N output features and walks the whole reduction, keeping a [BLOCK_N, BLOCK_K] fp32 accumulator that is summed
once at the end, so nothing is written twice and no second kernel reduces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    cdiv,
    check_inner_contiguous,
    check_linear_operands,
    check_out,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)

_BLOCK_N = 4  # output features per program: 4 gave the most bandwidth on every 7B shape (3584 to 152064 rows)
_MAX_BLOCK_K = 512


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask on the weight loads
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    # The first weight tile is requested before the wait for the previous kernel (no step writes weights): under
    # PDL its bytes stream in while that kernel drains.
    w = load_weight_tile(w_ptrs, n_mask, offs_k, 0, K, EVEN_K)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _accumulate(acc, w, x_ptr, offs_k, 0, K, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = load_weight_tile(w_ptrs + k0, n_mask, offs_k, k0, K, EVEN_K)
        acc = _accumulate(acc, w, x_ptr, offs_k, k0, K, EVEN_K)
    y = tl.sum(acc, 1)  # [BLOCK_N] fp32
    if HAS_BIAS:  # added to the fp32 sum before the one rounding, as cuBLAS's bias epilogue does
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def load_weight_tile(w_ptrs, n_mask, offs_k, k0, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column k0 (w_ptrs: the tile's pointers, already at k0), zeros outside
    the matrix."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, x_ptr, offs_k, k0, K, EVEN_K: tl.constexpr):
    """acc + w * x[k0:k0 + BLOCK_K], in fp32."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + offs_k)
    else:
        x = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias [N]) -> [1, N] in `out_dtype` (default x's dtype; float32 gives the
    unrounded sum, as `linear_fp32`). Same contract as F.linear for one row."""
    device, num_out, k = check_linear_operands(x, weight, bias, rows=1)
    out_dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty((1, num_out), dtype=out_dtype, device=device)
    check_out(out, (1, num_out), out_dtype, device)
    check_inner_contiguous("out", out)
    assert k >= 1, "weight: empty reduction dimension"
    if num_out == 0:
        return out
    block_k = min(_MAX_BLOCK_K, pow2_at_least(k, 16))
    _gemv_kernel[(cdiv(num_out, _BLOCK_N),)](
        x, weight, weight if bias is None else bias, out, num_out, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_N=_BLOCK_N, BLOCK_K=block_k,
        num_warps=8 if k >= 8192 else 4, num_stages=1, **pdl_launch(device),
    )  # fmt: skip
    return out
