import pytest
import torch
from kernel_cases import assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.gemv import gemv

# One rounding of an fp32 sum, as the reference's: about one unit in the last place apart (the sum order differs).
GEMV_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 sum of exact products, rounded once to x's dtype."""
    y = x.float() @ weight.float().T
    return (y if bias is None else y + bias.float()).to(x.dtype)


@dtype_params
@pytest.mark.parametrize("num_out, k", [(1, 16), (7, 600), (37, 1024), (130, 40)])  # ragged N; K below, off, on BLOCK_K
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_one_rounded_fp32_sum(dtype, num_out, k, with_bias):
    gen = torch.Generator().manual_seed(num_out * k)
    x = randn(1, k, dtype=dtype, generator=gen)
    weight = strided_view(randn(num_out, k, dtype=dtype, generator=gen))  # rows further apart than K
    bias = randn(num_out, dtype=dtype, generator=gen) if with_bias else None
    out = poisoned((1, num_out), dtype)
    assert gemv(x, weight, bias, out=out) is out
    assert_written_and_close(out, reference(x, weight, bias), GEMV_TOL)


def test_gemv_fp32_output_is_the_unrounded_sum():
    gen = torch.Generator().manual_seed(0)
    x, weight = randn(1, 700, dtype=torch.bfloat16, generator=gen), randn(9, 700, dtype=torch.bfloat16, generator=gen)
    out = gemv(x, weight, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ weight.float().T, atol=1e-4, rtol=1e-5)


def test_gemv_checks_its_operands():
    x = torch.zeros(2, 8, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with pytest.raises(AssertionError, match="x"):
        gemv(x, torch.zeros(4, 8, device=x.device))  # two rows
    with pytest.raises(AssertionError, match="weight"):
        gemv(x[:1], torch.zeros(4, 9, device=x.device))  # K differs
