"""The kernels that write a batch-1 FP8 GEMV's input with each row's largest magnitude (`MeasuredRows`): the norms
and the gated activations write what their plain launches write, bit for bit, and maxima whose largest is the row's
largest magnitude; quantize_measured given those maxima quantizes as quantize_fp8 does, bit for bit (the same
scale, so the same e4m3 values). Rows of several blocks: the gated activations measure per 1024 columns."""

import pytest
import torch
from kernel_cases import DEVICE, strided_view

from language.kernels import reference
from language.kernels.fp8_quant import quantize_fp8, quantize_measured
from language.kernels.rms_norm import add_rms_norm, add_rms_norm_measured, rms_norm, rms_norm_measured
from language.kernels.silu_mul import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_measured,
    silu_and_mul,
    silu_and_mul_measured,
)
from language.quant.fp8 import MeasuredRows, fp8_linear, quantize_weight

DTYPES = [torch.bfloat16, torch.float32]
ROWS_AND_WIDTHS = [(1, 64), (1, 3000), (4, 1000)]  # 3000 gated columns: three 1024-column blocks, the last partial


def _rows(rows: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 2).to(dtype).to(DEVICE)


def _assert_measured(got: MeasuredRows, plain: torch.Tensor) -> None:
    assert torch.equal(got.x, plain)
    assert got.amax.dtype == torch.float32 and got.amax.shape[0] == plain.shape[0]
    assert torch.equal(got.amax.amax(dim=1), plain.float().abs().amax(dim=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", ROWS_AND_WIDTHS)
def test_norms_measure_their_rows(dtype, rows, hidden):
    x = strided_view(_rows(rows, hidden, hidden, dtype))
    residual = _rows(rows, hidden, hidden + 1, dtype)
    weight = _rows(1, hidden, 3, dtype)[0]
    _assert_measured(rms_norm_measured(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    got, summed = add_rms_norm_measured(x, residual, weight, 1e-6)
    normed, want_summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed)
    _assert_measured(got, normed)
    ref, _ = reference.add_rms_norm_measured_ref(x.cpu(), residual.cpu(), weight.cpu(), 1e-6)
    torch.testing.assert_close(ref.amax, got.amax.amax(dim=1, keepdim=True).cpu(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", ROWS_AND_WIDTHS)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_gated_activations_measure_their_rows(dtype, rows, inter, gelu):
    x = strided_view(_rows(rows, 2 * inter, inter, dtype), pad=8)
    measured, plain = (gelu_tanh_and_mul_measured, gelu_tanh_and_mul) if gelu else (silu_and_mul_measured, silu_and_mul)
    got = measured(x)
    assert got.amax.shape == (rows, -(-inter // 1024))
    _assert_measured(got, plain(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 64), (1, 3000), (3, 1000)])
def test_measured_rows_quantize_as_quantize_fp8(dtype, rows, inter):
    """quantize_measured's programs, each a block of a row, scale by the producer's maxima: quantize_fp8's e4m3
    values and scales, bit for bit (a zero row included), and fp8_linear through it equals fp8_linear on the plain
    row."""
    gate_up = _rows(rows, 2 * inter, inter, dtype)
    gate_up[-1] = 0
    row = silu_and_mul_measured(gate_up)
    got = quantize_measured(row)
    q, scale = quantize_fp8(row.x)
    assert got.dtype == dtype and got.q.shape == q.shape
    assert torch.equal(got.scale, scale) and torch.equal(got.q.float(), q.float())
    weight, scales = quantize_weight(_rows(96, inter, inter + 7, torch.float32) * 0.05)
    assert torch.equal(fp8_linear(row, weight, scales), fp8_linear(row.x, weight, scales))


def test_quantize_measured_scales_by_the_given_maxima():
    """Other maxima move the scale off a power of two of the row's, so the scale and the e4m3 values move: the
    maxima are what the kernel reads."""
    x = _rows(1, 256, 11, torch.bfloat16)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    q, scale = quantize_fp8(x)
    got = quantize_measured(MeasuredRows(x, amax))
    assert torch.equal(got.scale, scale) and torch.equal(got.q.float(), q.float())
    moved = quantize_measured(MeasuredRows(x, 1.37 * amax))
    assert not torch.equal(moved.scale, scale) and not torch.equal(moved.q.float(), q.float())
