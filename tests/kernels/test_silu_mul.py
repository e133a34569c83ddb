import pytest
import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.reference import gelu_tanh_and_mul_ref, silu_and_mul_ref
from language.kernels.silu_mul import gelu_tanh_and_mul, silu_and_mul


@dtype_params
@pytest.mark.parametrize("num_rows, inter", [(1, 16), (6, 80), (3, 1500)])
def test_silu_and_mul_matches_reference(dtype, num_rows, inter):
    gen = torch.Generator().manual_seed(num_rows + inter)
    x = strided_view(randn(num_rows, 2 * inter, dtype=dtype, generator=gen) * 4)
    out = poisoned((num_rows, inter), dtype)
    assert silu_and_mul(x, out=out) is out
    assert_written_and_close(out, silu_and_mul_ref(x), ELEMENTWISE_TOL)


def test_silu_and_mul_rejects_odd_width():
    x = torch.zeros(2, 33, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(AssertionError, match="even"):
        silu_and_mul(x)


@dtype_params
@pytest.mark.parametrize("num_rows, inter", [(1, 16), (6, 80), (3, 1500)])
def test_gelu_tanh_and_mul_matches_reference(dtype, num_rows, inter):
    gen = torch.Generator().manual_seed(num_rows * inter)
    x = strided_view(randn(num_rows, 2 * inter, dtype=dtype, generator=gen) * 4)
    out = poisoned((num_rows, inter), dtype)
    assert gelu_tanh_and_mul(x, out=out) is out
    assert_written_and_close(out, gelu_tanh_and_mul_ref(x), ELEMENTWISE_TOL)


def test_gelu_tanh_and_mul_is_finite_at_the_extremes():
    """Gates far out on both sides, where exp over- and underflows: gelu -> 0 and -> gate, never NaN."""
    gate = torch.tensor([[-1e4, -100.0, -12.0, 0.0, 12.0, 100.0, 1e4]], device=DEVICE)
    x = torch.cat([gate, torch.ones_like(gate)], dim=1)
    torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x), atol=1e-5, rtol=1e-5)


def test_gelu_tanh_reference_is_hf_gemma3_activation():
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 64, generator=gen) * 3).to(torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul_ref(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)
