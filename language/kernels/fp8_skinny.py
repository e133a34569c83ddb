"""FP8 GEMM for a few rows (decode batches of 2 to 64) with per-token activation and per-channel weight scales:
the weight stream of skinny_gemm.py on e4m3 operands (half the bf16 weights' bytes).

The scales multiply each output once, after the reduction: out[m, n] = (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m]
* w_scale[n] (+ bias[n]). The activations come quantized: by the norm or gated activation that produced them
(fp8_quant.QuantizedRows), else by quantize_fp8 (one launch) beforehand: quantizing here
would need every program to read its rows' whole width for their maxima, 64 x K x 2 bytes from L2 per program at
M = 64 (~0.5 MB for K = 3584), more than the program's share of weights."""

from __future__ import annotations

import torch

from language.kernels.fp8_gemv import check_fp8_linear_operands
from language.kernels.skinny_gemm import launch_skinny
from language.kernels.skinny_launches import SkinnyConfig


def fp8_skinny_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with per-token scales x_scale [M, 1], weight [N, K] e4m3 with per-channel scales
    weight_scale [N, 1] (fp32) (+ bias [N]) -> [M, N] in out_dtype. Any M (made for 2 to 64; more rows are more
    row tiles, each streaming the weights again)."""
    check_fp8_linear_operands(x_q, x_scale, weight, weight_scale, bias, rows=None)
    assert weight_scale.shape[1] == 1, "fp8_skinny_gemm: per-channel scales only (grouped ones: fp8_gemm)"
    return launch_skinny(x_q, x_scale, weight, weight_scale, bias, out_dtype, out, config)
