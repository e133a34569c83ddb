import pytest
import torch
from kernel_cases import ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.reference import silu_and_mul_ref
from language.kernels.silu_mul import silu_and_mul


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
