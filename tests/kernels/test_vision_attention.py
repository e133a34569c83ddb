"""The vision towers' packed attention kernel (`visual/kernels/varlen_attention.py`) against per-image SDPA: head dims
that split into two exact parts (80 = 64 + 16, Qwen-VL's) and powers of two, images shorter and longer than a tile,
strided q/k/v."""

import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, dtype_params, randn, strided_view

from visual.kernels.varlen_attention import (
    CANDIDATES,
    AttentionConfig,
    head_dim_parts,
    varlen_attention,
    varlen_attention_ref,
)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@dtype_params
@pytest.mark.parametrize(
    "lengths, heads, head_dim", [([5, 37, 16], 2, 80), ([33], 3, 64), ([1, 20], 1, 48), ([70, 128, 200], 1, 80)]
)
def test_matches_per_image_sdpa(dtype, lengths, heads, head_dim):
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim)
    q, k, v = (randn(sum(lengths), heads, head_dim, dtype=dtype, generator=gen) for _ in range(3))
    cu, scale = _cu(lengths), head_dim**-0.5
    got = varlen_attention(q, k, v, cu, max(lengths), scale)
    assert got.shape == q.shape and got.is_contiguous()
    assert_written_and_close(got, varlen_attention_ref(q, k, v, cu, scale), ATTENTION_TOL)


@pytest.mark.parametrize("config", CANDIDATES, ids=str)
def test_every_candidate_launch_matches_per_image_sdpa(config):
    """The launches the tower bench times (any may become the default): images shorter than a query tile, ones that
    end inside a key tile and ones that fill whole tiles, in one batch."""
    lengths, heads, head_dim = [5, 70, 128, 200], 2, 80
    gen = torch.Generator().manual_seed(7)
    q, k, v = (randn(sum(lengths), heads, head_dim, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu, scale = _cu(lengths), head_dim**-0.5
    got = varlen_attention(q, k, v, cu, max(lengths), scale, config)
    assert_written_and_close(got, varlen_attention_ref(q, k, v, cu, scale), ATTENTION_TOL)


def test_attention_config_spec():
    assert AttentionConfig.parse("128x64x8x3") == AttentionConfig(128, 64, 8, 3)
    assert str(AttentionConfig.parse("256x64x8x2")) == "256x64x8x2"
    with pytest.raises(AssertionError, match="block_n must be a power of two"):
        q = torch.zeros(4, 1, 80, device=DEVICE)
        varlen_attention(q, q, q, _cu([4]), 4, 1.0, AttentionConfig(16, 48, 4, 1))


def test_images_do_not_see_each_other_and_strides_are_read():
    """Changing one image's keys changes only that image's rows; q/k/v as strided views give the same output."""
    gen = torch.Generator().manual_seed(3)
    lengths, heads, head_dim = [19, 24], 2, 80
    q, k, v = (randn(sum(lengths), heads, head_dim, dtype=torch.float32, generator=gen) for _ in range(3))
    cu = _cu(lengths)
    base = varlen_attention(q, k, v, cu, max(lengths), 0.3)
    k2 = k.clone()
    k2[19:] += 1.0
    changed = varlen_attention(q, k2, v, cu, max(lengths), 0.3)
    assert torch.equal(changed[:19], base[:19]) and not torch.allclose(changed[19:], base[19:])
    strided = varlen_attention(strided_view(q), strided_view(k), strided_view(v), cu, max(lengths), 0.3)
    assert_written_and_close(strided, base, ATTENTION_TOL)


def test_checks_its_operands():
    q = torch.zeros(4, 1, 80, device=DEVICE)
    cu = _cu([4])
    with pytest.raises(AssertionError, match="int32"):
        varlen_attention(q, q, q, cu.long(), 4, 1.0)
    with pytest.raises(AssertionError, match="one \\[tokens, heads, head_dim\\] shape"):
        varlen_attention(q, q[:3], q, cu, 4, 1.0)
    with pytest.raises(AssertionError, match="head_dim 72"):
        z = torch.zeros(4, 1, 72, device=DEVICE)
        varlen_attention(z, z, z, cu, 4, 1.0)


def test_head_dim_parts():
    assert head_dim_parts(80) == (64, 16) and head_dim_parts(64) == (64, 0) and head_dim_parts(96) == (64, 32)
    assert head_dim_parts(48) == (32, 16) and head_dim_parts(72) is None and head_dim_parts(8) is None
