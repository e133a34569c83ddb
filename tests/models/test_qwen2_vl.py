"""Qwen2-VL: our vision tower + merger equals HF Qwen2VLForConditionalGeneration's image features on a tiny random
checkpoint in the published layout (and the transformers-5 dialect); greedy generation through our LLM equals HF
generate for 1 and 2 images batched with a text-only request."""

from __future__ import annotations

import pytest
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor

import visual.models.qwen2_vl  # noqa: F401  (registers the architecture)
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from tests.models import qwen_vl_harness as vl
from tests.models.qwen_vl_harness import QwenVLFamily

FAMILY = QwenVLFamily("qwen2_vl", "Qwen2VLForConditionalGeneration", build_qwen2_vl, Qwen2VLForConditionalGeneration,
                      Qwen2VLProcessor, Qwen2VLVideoProcessor)  # fmt: skip
SIZES = [(150, 100), (60, 200), (333, 77)]  # (width, height), non-square, different grids
published_dir, hf_model = vl.checkpoint_fixtures(FAMILY)


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    vl.check_vision_features(FAMILY, dialect, published_dir, hf_model, tmp_path, SIZES)


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine: each equals HF generate,
    whether prompts run whole or in 6-token chunks (images and their M-RoPE positions split across steps)."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cpu", chunked_prefill_size, dtype="auto")


def test_greedy_generation_through_piecewise_graphs_matches_hf(published_dir: str, hf_model) -> None:
    """Every step (6-token chunks: images and their M-RoPE positions split across steps, then decode) replayed
    piece by piece with the attention between the pieces (uncaptured on CPU), padded to 16 or 32 rows."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cpu", 6, dtype="auto", piecewise_max_tokens=32)
