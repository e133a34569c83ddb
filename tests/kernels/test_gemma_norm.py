"""Gemma's RMSNorm kernels against their references, which are HF's Gemma3RMSNorm arithmetic: (1 + weight) in fp32,
one rounding at the end."""

import pytest
import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.gemma_norm import gemma_norm_add_norm, gemma_rms_norm
from language.kernels.reference import gemma_norm_add_norm_ref, gemma_rms_norm_ref, rms_norm_ref

# residual + norm(x) may cancel: a one-ulp difference in bf16's rounding of norm(x) (the interpreter rounds bf16 its
# own way) is then absolute, one ulp of addends up to ~8 here.
SUM_TOL = {**ELEMENTWISE_TOL, torch.bfloat16: (6.25e-2, 1.6e-2)}


@dtype_params
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (7, 80), (5, 1000)])
def test_gemma_rms_norm_matches_reference(dtype, num_rows, hidden):
    gen = torch.Generator().manual_seed(num_rows * hidden)
    x = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 3)
    weight = randn(hidden, dtype=dtype, generator=gen)
    out = poisoned((num_rows, hidden), dtype)
    assert gemma_rms_norm(x, weight, 1e-6, out=out) is out
    assert_written_and_close(out, gemma_rms_norm_ref(x, weight, 1e-6), ELEMENTWISE_TOL)


def test_gemma_reference_is_hf_gemma3_rms_norm():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    hf = Gemma3RMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=gen))
        x = (torch.randn(4, 96, generator=gen) * 5).to(torch.bfloat16)
        assert torch.equal(gemma_rms_norm_ref(x, hf.weight, 1e-6), hf(x))


def test_gemma_rms_norm_rounds_once_after_the_offset_weight():
    """Llama's rounding (normalise, round, then scale by a precomputed 1 + w) misses Gemma's on a third of these
    values; the kernel gives Gemma's (fp16: the interpreter rounds bf16 its own way, ELEMENTWISE_TOL)."""
    gen = torch.Generator().manual_seed(1)
    x = randn(16, 256, dtype=torch.float16, generator=gen) * 4
    weight = randn(256, dtype=torch.float16, generator=gen)
    expected = gemma_rms_norm_ref(x, weight, 1e-6)
    llama_way = rms_norm_ref(x, 1 + weight, 1e-6)
    assert (llama_way != expected).float().mean() > 0.2
    assert (gemma_rms_norm(x, weight, 1e-6) != expected).float().mean() < 0.01


@dtype_params
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (7, 80), (5, 1000)])
def test_gemma_norm_add_norm_matches_reference(dtype, num_rows, hidden):
    gen = torch.Generator().manual_seed(num_rows + hidden)
    x = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 3)
    residual = strided_view(randn(num_rows, hidden, dtype=dtype, generator=gen) * 2, pad=5)
    x_weight = randn(hidden, dtype=dtype, generator=gen)
    weight = randn(hidden, dtype=dtype, generator=gen)
    normed, summed = gemma_norm_add_norm(x, residual, x_weight, weight, 1e-6)
    want_normed, want_summed = gemma_norm_add_norm_ref(x, residual, x_weight, weight, 1e-6)
    assert normed.dtype == summed.dtype == dtype
    assert_written_and_close(summed, want_summed, SUM_TOL)
    assert_written_and_close(normed, want_normed, ELEMENTWISE_TOL)


def test_gemma_norm_add_norm_normalises_x_with_its_own_weight():
    """The two weights are not interchangeable: x's norm scales by x_weight, the sum's by weight."""
    gen = torch.Generator().manual_seed(2)
    x, residual = randn(3, 64, dtype=torch.float32, generator=gen), randn(3, 64, dtype=torch.float32, generator=gen)
    x_weight, weight = randn(64, dtype=torch.float32, generator=gen), randn(64, dtype=torch.float32, generator=gen)
    normed, summed = gemma_norm_add_norm(x, residual, x_weight, weight, 1e-6)
    want_summed = residual + gemma_rms_norm_ref(x, x_weight, 1e-6)
    torch.testing.assert_close(summed, want_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, gemma_rms_norm_ref(want_summed, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_gemma_norm_add_norm_rejects_a_wrong_weight():
    x = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="x_weight"):
        gemma_norm_add_norm(x, x, torch.ones(16, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)


def test_gemma_rms_norm_rejects_a_wrong_out_dtype():
    x = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(AssertionError):
        gemma_rms_norm(
            x, torch.ones(32, device=DEVICE), 1e-6, out=torch.empty(2, 32, dtype=torch.float16, device=DEVICE)
        )
