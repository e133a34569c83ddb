"""FP8 (e4m3) linear arithmetic: quantizing weights and activations, and the scaled matmul, on CUDA through
cuBLASLt (`torch._scaled_mm`) and our Triton kernels, elsewhere through a torch reference of the same quantized
arithmetic (the dequantized values multiplied in fp32), so the engine runs quantized on CPU in tests.

Scales multiply: x ~= q * scale. A weight's scales are [N, G] fp32: G = 1 per output channel (quantized at load,
`--quant_type fp8w8a8`, and compressed-tensors' FP8-dynamic checkpoints), or one per 128 columns (block-wise
checkpoints: each 128x128 block's scale repeated over its rows, `expand_block_scales`). Activations are quantized
per token, dynamically, in the weight's groups: one scale per row, or per row and 128 columns. Per-channel weights
also take rows quantized per token by the kernel that produced them (`QuantizedRows`: the norms and gated
activations of language/kernels), the same values the linear would have quantized, without re-reading them, and a
decode step's single row with its largest magnitude measured by its producer (`MeasuredRows`), which the batch-1
GEMV quantizes as it streams the weights."""

from __future__ import annotations

import torch

from language.kernels.fp8_gemm import fp8_gemm
from language.kernels.fp8_gemv import fp8_gemv, fp8_gemv_fused, group_size
from language.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    MeasuredRows,
    QuantizedRows,
    quantize_fp8,
    quantize_measured,
)
from language.kernels.fp8_skinny import fp8_skinny_gemm
from language.kernels.reference import quantize_rows_ref
from language.kernels.skinny_launches import SKINNY_MAX_ROWS

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MeasuredRows",
    "QuantizedRows",
    "expand_block_scales",
    "fp8_linear",
    "fp8_linear_ref",
    "quantize_weight",
    "weight_scales",
]


def quantize_weight(weight: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] -> (e4m3 [N, K], per-output-channel scales [N, 1] fp32). `scales`: given ones (a
    row-parallel shard's, taken over the whole rows), else each row's largest magnitude over 448."""
    if scales is None:
        scales = weight_scales(weight)
    q = (weight.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales [N, 1] fp32 of a weight [N, K]."""
    return (weight.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)


def expand_block_scales(block_scales: torch.Tensor, block_rows: int) -> torch.Tensor:
    """A block-wise checkpoint's scales [ceil(N / b), G] -> per row [ceil(N / b) * b, G] (the caller keeps its N
    rows)."""
    return block_scales.float().repeat_interleave(block_rows, dim=0)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [R, K] e4m3 with scales [R, G] -> [R, K] fp32 (each scale over ceil(K / G) rounded up to a power of two
    columns, as the kernels read them)."""
    k, groups = q.shape[1], scales.shape[1]
    group = k if groups == 1 else group_size(k, groups)
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :k]


def fp8_linear_ref(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The quantized arithmetic in torch: x [n, K] quantized as the kernels do (or given quantized), both operands
    dequantized to fp32 and multiplied -> [n, N] in out_dtype (default x's)."""
    if isinstance(x, QuantizedRows):
        x_q, x_scale, x_dtype = x
    else:
        x_q, x_scale = quantize_rows_ref(x, _activation_group(x.shape[-1], weight_scale.shape[1]))
        x_dtype = x.dtype
    y = dequantize(x_q, x_scale) @ dequantize(weight, weight_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x_dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows | MeasuredRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [n, K] @ dequantized weight [N, K].T (+ bias) -> [n, N] in out_dtype (default x's): x quantized per token
    (in the weight's column groups; or given so, for per-channel weights; or with its rows' maxima), then the FP8
    GEMM. On CUDA, one row: per-channel weights through the FP8 GEMV (which quantizes a float row itself: one
    launch; a measured row goes through quantize_measured first), grouped ones through the quantizer and the GEMV;
    more rows: per-channel weights through our weight-streaming GEMM up to SKINNY_MAX_ROWS rows, cuBLASLt's
    row-wise scaled GEMM beyond, grouped ones through our block-scaled kernel."""
    if isinstance(x, MeasuredRows):  # the producer measured the rows' maxima: quantized by many programs at once
        measured = x.x.is_cuda and weight_scale.shape[1] == 1
        if not measured:
            return fp8_linear(x.x, weight, weight_scale, bias, out_dtype)
        x = quantize_measured(x)
    if isinstance(x, QuantizedRows):
        assert weight_scale.shape[1] == 1, "rows quantized per token need per-channel weight scales"
        if not x.q.is_cuda:
            return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)
        return _quantized_linear(x.q, x.scale, weight, weight_scale, bias, out_dtype or x.dtype)
    out_dtype = out_dtype or x.dtype
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)
    groups = weight_scale.shape[1]
    if x.shape[0] == 1 and groups == 1:
        return fp8_gemv_fused(x, weight, weight_scale, bias, out_dtype=out_dtype)
    x_q, x_scale = quantize_fp8(x, _activation_group(x.shape[1], groups))
    return _quantized_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def _quantized_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The FP8 GEMM of quantized rows on CUDA, by row count and the weight's scale groups."""
    groups = weight_scale.shape[1]
    if x_q.shape[0] == 1:  # grouped scales: fusing measured 1.9x slower on an H100 (benchmarks/fp8_gemv_bench.py)
        return fp8_gemv(x_q, x_scale, weight, weight_scale, bias, out_dtype=out_dtype)
    if groups == 1 and x_q.shape[0] <= SKINNY_MAX_ROWS:
        return fp8_skinny_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype=out_dtype)
    if groups > 1 or x_q.shape[1] % 16 or weight.shape[0] % 16:  # cuBLASLt wants both dims in 16s
        return fp8_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype=out_dtype)
    return _rowwise_scaled_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def _rowwise_scaled_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with a scale per row of x and per row of the weight. It writes bf16 only with row-wise
    scales: an fp32 result (the row-parallel partial sums) is its bf16 output widened. A bf16 bias is added in its
    epilogue (torch takes a bias with row-wise scales in the output's dtype, bf16 or fp16), so added to the fp32 sum
    before the one rounding, as the reference adds it; another dtype's bias, after."""
    fused_bias = bias if bias is not None and bias.dtype == torch.bfloat16 else None
    y = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=fused_bias, out_dtype=torch.bfloat16
    )  # [n, N]
    if bias is not None and fused_bias is None:
        y = y + bias
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _activation_group(k: int, weight_groups: int) -> int | None:
    """Columns per activation scale: the weight's groups (None: the whole row)."""
    return None if weight_groups == 1 else group_size(k, weight_groups)
