"""M-RoPE positions equal transformers' Qwen2VLModel.get_rope_index on several prompt layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from language.models.qwen2_vl_positions import mrope_decode_position, mrope_positions

IMAGE, START, END = 151655, 151652, 151653


@pytest.fixture(scope="module")
def hf_model() -> Qwen2VLModel:
    cfg = Qwen2VLConfig(
        text_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
            vocab_size=200,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=16),
    )
    return Qwen2VLModel(cfg).eval()


def _prompt(layout: list) -> list[int]:
    """layout: ints = that many text tokens; (t, h, w) = an image with that patch grid."""
    ids: list[int] = []
    for part in layout:
        if isinstance(part, int):
            ids += [7 + (i % 50) for i in range(part)]
        else:
            ids += [START] + [IMAGE] * (part[0] * part[1] * part[2] // 4) + [END]
    return ids


LAYOUTS = [
    [12],  # text only
    [3, (1, 4, 6), 5],  # one wide image
    [2, (1, 8, 4), 4, (1, 6, 10), 7],  # two images, different grids
    [(1, 2, 2), 1],  # image first, 1-token image
    [5, (1, 10, 6), (1, 4, 4), 3],  # two adjacent images
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_hf_get_rope_index(hf_model: Qwen2VLModel, layout: list) -> None:
    ids = _prompt(layout)
    grids = [list(p) for p in layout if not isinstance(p, int)]
    ours, delta = mrope_positions(ids, grids, IMAGE, START, spatial_merge_size=2)

    input_ids = torch.tensor([ids])
    grid_thw = torch.tensor(grids) if grids else None
    if grids:
        hf_pos, hf_delta = hf_model.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=grid_thw)
        hf_pos, hf_delta = hf_pos[:, 0], int(hf_delta[0, 0])
    else:  # HF uses plain arange positions for text-only prompts
        hf_pos, hf_delta = torch.arange(len(ids)).expand(3, -1), 0
    assert ours.dtype == torch.int64 and ours.shape == (3, len(ids))
    assert torch.equal(ours, hf_pos)
    assert delta == hf_delta
    # HF's decode step: cache_position + rope_deltas on all three axes.
    assert mrope_decode_position(len(ids) + 3, delta) == len(ids) + 3 + hf_delta


def test_rejects_wrong_placeholder_count() -> None:
    ids = [1, START] + [IMAGE] * 5 + [END]
    with pytest.raises(ValueError):
        mrope_positions(ids, [[1, 4, 6]], IMAGE, START)
    with pytest.raises(ValueError):
        mrope_positions(ids, [], IMAGE, START)
