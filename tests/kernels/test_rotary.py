import pytest
import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn, strided_view

from language.kernels.reference import apply_rotary_ref, mrope_cos_sin_ref, rotary_cos_sin_ref
from language.kernels.rotary import apply_rotary, mrope_cos_sin, rotary_cos_sin

# cos/sin are fp32 functions of fp32 angles up to a few thousand radians; both sides round the same angle.
TABLE_TOL = {torch.float32: (2e-6, 1e-5)}


def inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return (1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).to(DEVICE)


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_rotary_cos_sin_matches_reference(head_dim):
    positions = torch.tensor([0, 1, 2, 37, 511, 4095, 32767, 5], device=DEVICE)  # ragged, not sorted
    out = (poisoned((8, head_dim // 2), torch.float32), poisoned((8, head_dim // 2), torch.float32))
    cos, sin = rotary_cos_sin(positions, inv_freq(head_dim), out=out)
    assert cos is out[0] and sin is out[1]
    cos_ref, sin_ref = rotary_cos_sin_ref(positions, inv_freq(head_dim))
    assert_written_and_close(cos, cos_ref, TABLE_TOL)
    assert_written_and_close(sin, sin_ref, TABLE_TOL)


@pytest.mark.parametrize(
    "head_dim, section, interleaved",
    [(16, [2, 3, 3], False), (128, [16, 24, 24], False), (32, [6, 5, 5], True), (128, [24, 20, 20], True)],
)
def test_mrope_cos_sin_matches_reference(head_dim, section, interleaved):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = 45  # spans two token blocks
    positions = torch.randint(0, 3000, (3, num_tokens), generator=gen).to(DEVICE)
    out = (poisoned((num_tokens, head_dim // 2), torch.float32), poisoned((num_tokens, head_dim // 2), torch.float32))
    cos, sin = mrope_cos_sin(positions, inv_freq(head_dim), section, interleaved, out=out)
    cos_ref, sin_ref = mrope_cos_sin_ref(positions, inv_freq(head_dim), section, interleaved)
    assert_written_and_close(cos, cos_ref, TABLE_TOL)
    assert_written_and_close(sin, sin_ref, TABLE_TOL)


def test_mrope_cos_sin_each_band_follows_its_axis():
    head_dim, section = 16, [2, 3, 3]
    positions = torch.stack([torch.full((4,), p) for p in (5, 70, 900)]).to(DEVICE)
    cos, _ = mrope_cos_sin(positions, inv_freq(head_dim), section)
    for axis, band in zip((0, 0, 1, 1, 1, 2, 2, 2), range(8), strict=True):
        expected = torch.cos(positions[axis, 0].float() * inv_freq(head_dim)[band])
        torch.testing.assert_close(cos[:, band], expected.expand(4), atol=2e-6, rtol=1e-5)


def test_interleaved_mrope_equals_hf_qwen3_vl():
    """Qwen3-VL's layout (transformers' Qwen3VLTextRotaryEmbedding): bands cycle t, h, w from band 0, h and w each
    for 3 * section bands, the rest temporal."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = [24, 20, 20]
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": section, "mrope_interleaved": True}
    config = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=rope)
    hf = Qwen3VLTextRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 3000, (3, 1, 37), generator=gen)
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions)  # [1, 37, 128]: the half, twice
    cos, sin = mrope_cos_sin(positions[:, 0].to(DEVICE), hf.inv_freq.to(DEVICE), section, True)
    torch.testing.assert_close(cos.cpu(), cos_hf[0, :, :64], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sin.cpu(), sin_hf[0, :, :64], atol=2e-6, rtol=1e-5)


@dtype_params
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(1, 2, 16), (7, 5, 80), (4, 20, 128)])
def test_apply_rotary_matches_reference(dtype, num_tokens, num_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens * num_heads)
    x = strided_view(randn(num_tokens, num_heads, head_dim, dtype=dtype, generator=gen))  # a slice of fused qkv
    x_before = x.clone()
    positions = torch.randint(0, 2048, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = rotary_cos_sin_ref(positions, inv_freq(head_dim))
    out = poisoned((num_tokens, num_heads, head_dim), dtype)
    assert apply_rotary(x, cos, sin, out=out) is out
    assert_written_and_close(out, apply_rotary_ref(x, cos, sin), ELEMENTWISE_TOL)
    assert torch.equal(x, x_before), "apply_rotary must not modify its input"


def test_apply_rotary_rejects_wrong_table_width():
    x = torch.zeros(3, 2, 32, device=DEVICE)
    table = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="cos"):
        apply_rotary(x, table, table)
