"""The vision towers' kernels (`visual/kernels`): the fused qkv split + 2-D rotary, QuickGELU and the residual add +
LayerNorm against their torch references, and the references against transformers' own arithmetic, bit for bit."""

import pytest
import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, randn, strided_view
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

from visual.kernels.add_layer_norm import add_layer_norm, add_layer_norm_ref
from visual.kernels.qkv_rotary import qkv_rotary, qkv_rotary_ref
from visual.kernels.quick_gelu import quick_gelu, quick_gelu_ref


def _cos_sin(num_tokens: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as the towers build them: [tokens, head_dim] fp32, both halves equal (the table is concatenated)."""
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 60  # rows and columns of large images
    table = torch.cat([angles, angles], dim=-1)
    return table.cos().to(DEVICE), table.sin().to(DEVICE)


@dtype_params
@pytest.mark.parametrize("num_tokens, heads, head_dim", [(1, 1, 8), (37, 3, 80), (130, 2, 64)])
def test_qkv_rotary_matches_reference(dtype, num_tokens, heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens * heads + head_dim)
    qkv = randn(num_tokens, 3 * heads * head_dim, dtype=dtype, generator=gen)
    cos, sin = _cos_sin(num_tokens, head_dim, gen)
    got = qkv_rotary(qkv, cos, sin, heads)
    want = qkv_rotary_ref(qkv, cos, sin, heads)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == (num_tokens, heads, head_dim) and g.is_contiguous(), name
        assert_written_and_close(g, w, ELEMENTWISE_TOL)
    assert torch.equal(got[2], want[2])  # v is copied, not computed


@dtype_params
def test_qkv_rotary_reference_is_transformers_arithmetic(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, head_dim = 50, 4, 80
    qkv = torch.randn(num_tokens, 3 * heads * head_dim, generator=gen).to(dtype)
    cos, sin = (t.cpu() for t in _cos_sin(num_tokens, head_dim, gen))
    q, k, v = qkv_rotary_ref(qkv, cos, sin, heads)
    hf_q, hf_k, hf_v = qkv.reshape(num_tokens, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    hf_q, hf_k = apply_rotary_pos_emb_vision(hf_q, hf_k, cos, sin)
    assert torch.equal(q, hf_q) and torch.equal(k, hf_k) and torch.equal(v, hf_v)


def test_qkv_rotary_reads_a_strided_table_and_checks_shapes():
    gen = torch.Generator().manual_seed(1)
    qkv = randn(9, 3 * 2 * 16, dtype=torch.float32, generator=gen)
    cos, sin = _cos_sin(9, 16, gen)
    half = (cos[:, :8], sin[:, :8])  # a [tokens, D/2] view with the full table's row stride
    for g, w in zip(qkv_rotary(qkv, *half, 2), qkv_rotary_ref(qkv, cos, sin, 2), strict=True):
        assert_written_and_close(g, w, ELEMENTWISE_TOL)
    with pytest.raises(AssertionError, match="qkv"):
        qkv_rotary(qkv[:, :-1], cos, sin, 2)
    with pytest.raises(AssertionError, match="cos"):
        qkv_rotary(qkv, cos[:5], sin, 2)


@dtype_params
@pytest.mark.parametrize("shape", [(1,), (7, 300), (3, 2049)])
def test_quick_gelu_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, generator=gen) * 4
    assert_written_and_close(quick_gelu(x), quick_gelu_ref(x), ELEMENTWISE_TOL)


def test_quick_gelu_reference_is_transformers_activation():
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(2)) * 5
    assert torch.equal(quick_gelu_ref(x), QuickGELUActivation()(x))


@dtype_params
@pytest.mark.parametrize("rows, width", [(1, 16), (37, 80), (6, 1280), (3, 1152)])
def test_add_layer_norm_matches_reference(dtype, rows, width):
    """h is torch's add, bit for bit; the norm within a unit of the last place (fp32 statistics either way). x comes
    as a strided view (a residual sliced out of a wider buffer); widths that are not powers of two leave lanes
    masked."""
    gen = torch.Generator().manual_seed(rows * width)
    x, y = (randn(rows, width, dtype=dtype, generator=gen) * 3 for _ in range(2))
    weight, bias = randn(width, dtype=dtype, generator=gen), randn(width, dtype=dtype, generator=gen)
    h, out = add_layer_norm(strided_view(x), y, weight, bias, 1e-6)
    want_h, want_out = add_layer_norm_ref(x, y, weight, bias, 1e-6)
    assert h.is_contiguous() and out.is_contiguous() and out.dtype == dtype
    if DEVICE.type == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates to bf16 where CUDA rounds
        assert torch.equal(h, want_h)
    assert_written_and_close(h, want_h, ELEMENTWISE_TOL)
    assert_written_and_close(out, want_out, ELEMENTWISE_TOL)


def test_add_layer_norm_normalises_large_offsets():
    """Rows whose mean dwarfs their spread (the residual stream of a deep tower): the statistics must be of the
    rounded h, centred before squaring: E[h^2] - E[h]^2 in fp32 would be ~3 % off here. Both sides' sums run in
    different orders, so they agree to ~1e-4 at this offset, not to fp32's last place."""
    gen = torch.Generator().manual_seed(4)
    x = randn(4, 96, dtype=torch.float32, generator=gen) + 1000.0
    y = randn(4, 96, dtype=torch.float32, generator=gen)
    weight, bias = torch.ones(96, device=DEVICE), torch.zeros(96, device=DEVICE)
    _, out = add_layer_norm(x, y, weight, bias, 1e-6)
    torch.testing.assert_close(out, add_layer_norm_ref(x, y, weight, bias, 1e-6)[1], atol=1e-3, rtol=1e-3)


def test_add_layer_norm_checks_its_operands():
    x = torch.zeros(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(AssertionError, match="one \\[rows, width\\] shape"):
        add_layer_norm(x, x[:2], w, w, 1e-6)
    with pytest.raises(AssertionError, match="weight and bias"):
        add_layer_norm(x, x, w[:4], w, 1e-6)
    with pytest.raises(AssertionError, match="rows must be contiguous"):
        add_layer_norm(x.t().contiguous().t(), x, w, w, 1e-6)
    with pytest.raises(AssertionError, match="dtype|is torch"):
        add_layer_norm(x, x.half(), w, w, 1e-6)
