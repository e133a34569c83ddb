"""The kernels that write an FP8 linear's input already quantized (`QuantizedRows`): the norms and the gated
activations, against the unquantized kernel then quantize_fp8, bit for bit (the same e4m3 values, the same scales),
and against the torch references the engine runs on CPU. One row and many; rows of several blocks (the gated
activations' programs step over a row 4096 columns at a time); values over four decades, so that every e4m3 binade
is met, subnormals included; an all-zero row."""

import pytest
import torch
from kernel_cases import DEVICE, strided_view

from language.kernels import reference
from language.kernels.fp8_quant import FP8_DTYPE, QuantizedRows, quantize_fp8
from language.kernels.rms_norm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8
from language.kernels.silu_mul import gelu_tanh_and_mul, gelu_tanh_and_mul_fp8, silu_and_mul, silu_and_mul_fp8

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS_AND_WIDTHS = [(1, 64), (6, 1000), (3, 9000)]  # 9000: a gated row of three 4096-column steps


def _spread(rows: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over four decades in random columns, the first row all zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 3 * torch.logspace(-4, 0, width)[torch.randperm(width, generator=gen)]
    x[0] = 0
    return x.to(dtype).to(DEVICE)


def _assert_equal_rows(got: QuantizedRows, unquantized: torch.Tensor) -> None:
    """got: bit for bit quantize_fp8 of the unquantized kernel's output."""
    want_q, want_scale = quantize_fp8(unquantized)
    assert got.q.dtype == FP8_DTYPE and got.q.is_contiguous() and got.dtype == unquantized.dtype
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))


def _assert_matches_reference(got: QuantizedRows, reference_rows: QuantizedRows) -> None:
    """The CPU path's result, up to a step of e4m3: the unquantized kernel may differ from its reference by a last
    place or two (the interpreter's bf16 rounding), which may move a value (and the row's scale) to the next e4m3
    value: a step is at most 1/8 of the value above e4m3's subnormals, 2^-9 of the scale within them."""
    torch.testing.assert_close(got.scale.cpu(), reference_rows.scale, rtol=1.6e-2, atol=0)
    dequantized = got.q.cpu().float() * got.scale.cpu()
    expected = reference_rows.q.float() * reference_rows.scale
    bound = expected.abs() * (1 / 8 + 2 * 1.6e-2) + reference_rows.scale * 2.0**-8
    assert ((dequantized - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", ROWS_AND_WIDTHS)
def test_rms_norm_fp8_is_the_norm_then_the_quantizer(dtype, rows, hidden):
    x = strided_view(_spread(rows, hidden, rows + hidden, dtype))
    weight = _spread(2, hidden, hidden, dtype)[1]
    got = rms_norm_fp8(x, weight, 1e-6)
    _assert_equal_rows(got, rms_norm(x, weight, 1e-6))
    _assert_matches_reference(got, reference.rms_norm_fp8_ref(x.cpu(), weight.cpu(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", ROWS_AND_WIDTHS)
def test_add_rms_norm_fp8_is_the_norm_then_the_quantizer(dtype, rows, hidden):
    x = strided_view(_spread(rows, hidden, rows * hidden, dtype))
    residual = _spread(rows, hidden, hidden - rows, dtype)
    residual[0] = 0  # with x's zero row: a zero sum, whose values quantize to 0
    weight = _spread(2, hidden, hidden, dtype)[1]
    got, summed = add_rms_norm_fp8(x, residual, weight, 1e-6)
    normed, want_summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed)
    _assert_equal_rows(got, normed)
    assert not got.q[0].float().any()
    ref_rows, _ = reference.add_rms_norm_fp8_ref(x.cpu(), residual.cpu(), weight.cpu(), 1e-6)
    _assert_matches_reference(got, ref_rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", ROWS_AND_WIDTHS)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_gated_activation_fp8_is_the_product_then_the_quantizer(dtype, rows, inter, gelu):
    x = strided_view(_spread(rows, 2 * inter, rows + 2 * inter, dtype), pad=8)
    fused, unfused = (gelu_tanh_and_mul_fp8, gelu_tanh_and_mul) if gelu else (silu_and_mul_fp8, silu_and_mul)
    got = fused(x)
    _assert_equal_rows(got, unfused(x))
    assert not got.q[0].float().any()
    ref = reference.gelu_tanh_and_mul_fp8_ref if gelu else reference.silu_and_mul_fp8_ref
    _assert_matches_reference(got, ref(x.cpu()))


def test_producers_take_no_rows():
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_fp8(x, torch.ones(64, dtype=torch.bfloat16, device=DEVICE), 1e-6).q.shape == (0, 64)
    assert silu_and_mul_fp8(x).scale.shape == (0, 1)


def test_quantized_norm_refuses_a_promoting_weight():
    """A weight of another dtype promotes the unquantized output; the quantized one rounds to x's dtype."""
    x = torch.ones(2, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm_fp8(x, torch.ones(32, device=DEVICE), 1e-6)
