import pytest
import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.head_rms_norm import qk_rms_norm
from language.kernels.reference import qk_rms_norm_ref, rms_norm_ref


@dtype_params
@pytest.mark.parametrize("num_tokens, q_heads, k_heads, head_dim", [(1, 2, 1, 16), (7, 4, 2, 128), (5, 20, 4, 80)])
def test_qk_rms_norm_matches_reference(dtype, num_tokens, q_heads, k_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens * q_heads * head_dim)
    # The q and k heads as a view into a fused qkv row (tokens further apart than the heads they hold).
    qk = strided_view(randn(num_tokens, q_heads + k_heads, head_dim, dtype=dtype, generator=gen) * 3)
    before = qk.clone()
    q_weight = randn(head_dim, dtype=dtype, generator=gen)
    k_weight = randn(head_dim, dtype=dtype, generator=gen)
    out = poisoned((num_tokens, q_heads + k_heads, head_dim), dtype)
    assert qk_rms_norm(qk, q_weight, k_weight, q_heads, 1e-6, out=out) is out
    assert_written_and_close(out, qk_rms_norm_ref(qk, q_weight, k_weight, q_heads, 1e-6), ELEMENTWISE_TOL)
    assert torch.equal(qk, before), "qk_rms_norm must not modify its input"


@dtype_params
def test_qk_rms_norm_in_place_in_a_fused_qkv(dtype):
    """As the decoder runs it: the q and k heads of a fused [N, Hq + 2 Hk, D] qkv normalised in place, v untouched."""
    gen = torch.Generator().manual_seed(3)
    qkv = randn(6, 4 + 2 * 2, 32, dtype=dtype, generator=gen) * 3
    before = qkv.clone()
    q_weight, k_weight = randn(32, dtype=dtype, generator=gen), randn(32, dtype=dtype, generator=gen)
    qk = qkv[:, :6]
    assert qk_rms_norm(qk, q_weight, k_weight, 4, 1e-6, out=qk) is qk
    assert_written_and_close(qkv[:, :6], qk_rms_norm_ref(before[:, :6], q_weight, k_weight, 4, 1e-6), ELEMENTWISE_TOL)
    assert torch.equal(qkv[:, 6:], before[:, 6:])


def test_qk_rms_norm_uses_each_weight_on_its_own_heads():
    gen = torch.Generator().manual_seed(0)
    qk = randn(3, 5, 32, dtype=torch.float32, generator=gen)
    q_weight = randn(32, dtype=torch.float32, generator=gen)
    k_weight = randn(32, dtype=torch.float32, generator=gen)
    out = qk_rms_norm(qk, q_weight, k_weight, 3, 1e-6)
    torch.testing.assert_close(out[:, :3], rms_norm_ref(qk[:, :3], q_weight, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 3:], rms_norm_ref(qk[:, 3:], k_weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_qk_rms_norm_rejects_a_wrong_weight():
    qk = torch.zeros(2, 3, 16, device=DEVICE)  # the launcher's checks run where its kernel would (GPU, else CPU)
    with pytest.raises(AssertionError, match="k_weight"):
        qk_rms_norm(qk, torch.ones(16, device=DEVICE), torch.ones(8, device=DEVICE), 2, 1e-6)


@dtype_params
@pytest.mark.parametrize("num_tokens, q_heads, k_heads, head_dim", [(1, 2, 1, 16), (5, 4, 2, 256)])
def test_gemma_qk_rms_norm_matches_reference(dtype, num_tokens, q_heads, k_heads, head_dim):
    """Gemma 3's q/k norms: (1 + weight) in fp32, one rounding; read out of a fused qkv row."""
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qk = strided_view(randn(num_tokens, q_heads + k_heads, head_dim, dtype=dtype, generator=gen) * 3)
    q_weight = randn(head_dim, dtype=dtype, generator=gen)
    k_weight = randn(head_dim, dtype=dtype, generator=gen)
    got = qk_rms_norm(qk, q_weight, k_weight, q_heads, 1e-6, gemma=True)
    expected = qk_rms_norm_ref(qk, q_weight, k_weight, q_heads, 1e-6, gemma=True)
    assert_written_and_close(got, expected, ELEMENTWISE_TOL)
    assert not torch.allclose(expected, qk_rms_norm_ref(qk, q_weight, k_weight, q_heads, 1e-6), atol=0.1)


def test_gemma_qk_reference_is_hf_gemma3_rms_norm():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(4)
    q_norm, k_norm = Gemma3RMSNorm(32, eps=1e-6).to(torch.bfloat16), Gemma3RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(32, generator=gen))
        k_norm.weight.copy_(torch.randn(32, generator=gen))
        qk = (torch.randn(3, 6, 32, generator=gen) * 4).to(torch.bfloat16)
        expected = torch.cat([q_norm(qk[:, :4]), k_norm(qk[:, 4:])], dim=1)
        assert torch.equal(qk_rms_norm_ref(qk, q_norm.weight, k_norm.weight, 4, 1e-6, gemma=True), expected)
