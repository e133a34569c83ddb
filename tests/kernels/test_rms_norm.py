import pytest
import torch
from kernel_cases import ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.reference import rms_norm_ref
from language.kernels.rms_norm import rms_norm


@dtype_params
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (7, 80), (5, 1000)])
def test_rms_norm_matches_reference(dtype, num_rows, hidden):
    gen = torch.Generator().manual_seed(num_rows * hidden)
    x = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 3)
    weight = randn(hidden, dtype=dtype, generator=gen)
    out = poisoned((num_rows, hidden), dtype)
    result = rms_norm(x, weight, 1e-6, out=out)
    assert result is out
    assert_written_and_close(out, rms_norm_ref(x, weight, 1e-6), ELEMENTWISE_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_fp32_weight_promotes_like_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x = randn(3, 48, dtype=dtype, generator=gen)
    weight = randn(48, dtype=torch.float32, generator=gen)
    expected = rms_norm_ref(x, weight, 1e-5)
    result = rms_norm(x, weight, 1e-5)
    assert result.dtype == expected.dtype == torch.float32
    assert_written_and_close(result, expected, {torch.float32: ELEMENTWISE_TOL[dtype]})


def test_rms_norm_rejects_mismatched_weight():
    x = torch.zeros(2, 32, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, torch.ones(16, device=x.device), 1e-6)


@dtype_params
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (7, 80), (5, 1000)])
def test_add_rms_norm_matches_reference(dtype, num_rows, hidden):
    from language.kernels.reference import add_rms_norm_ref
    from language.kernels.rms_norm import add_rms_norm

    gen = torch.Generator().manual_seed(num_rows + hidden)
    x = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 3)
    residual = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 2, pad=5)
    weight = randn(hidden, dtype=dtype, generator=gen)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_summed = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert_written_and_close(summed, want_summed, ELEMENTWISE_TOL)
    assert_written_and_close(normed, want_normed, ELEMENTWISE_TOL)
