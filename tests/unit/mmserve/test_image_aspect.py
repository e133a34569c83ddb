"""Extreme aspect ratios, family by family (B7 of issue 34): what each family's image processor does with a 1x4000
image decides whether the server refuses it from the header (a 400 that says why) or serves it."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from families import family
from mmserve.prep.multimodal.image_io import BadImage
from mmserve.prep.multimodal.llava import LlavaPromptProcessor
from mmserve.prep.multimodal.prompt import MAX_ASPECT_RATIO, prompt_processor_class
from mmserve.prep.multimodal.qwen_vl import QwenVLPromptProcessor
from mmserve.testing.checkpoints.qwen_vl import build_qwen_vl
from visual.models.qwen_vl import QwenVLVisionModel
from visual.preprocess import decode_and_preprocess

EXTREME = [(1, 4000), (4000, 1), (3, 700)]


QWEN2_VL_FAMILY = [
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
]


@pytest.mark.parametrize("architecture", QWEN2_VL_FAMILY)
@pytest.mark.parametrize("width, height", EXTREME)
def test_the_qwen2_vl_family_refuses_what_smart_resize_refuses(architecture, width, height):
    assert family(architecture).checks_image_size  # the server calls it
    processor = prompt_processor_class(architecture)(
        None, 0, 0, patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    )
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)  # HF's own processor would raise
    with pytest.raises(BadImage, match=rf"{width}x{height}: its aspect ratio \d+:1 is above 200:1"):
        processor.check_image_size(width, height)
    processor.check_image_size(1, MAX_ASPECT_RATIO)  # the bound itself is allowed, and HF computes its grid
    assert processor.grid_thw(1, MAX_ASPECT_RATIO)[0] == 1


@pytest.mark.parametrize("width, height", EXTREME)
def test_llava_refuses_them_too(width, height):
    """CLIP's processor scales the short side to the tower's size first: a 1x4000 image is resized to 336x1344000
    (about 4 GB and 10 s of a worker) before its centre crop."""
    processor = LlavaPromptProcessor(None, 576, 32000, 32000)
    with pytest.raises(BadImage, match="above 200:1"):
        processor.check_image_size(width, height)
    processor.check_image_size(1, 200)


def test_llava_padding_to_a_square_is_bounded():
    padded = LlavaPromptProcessor(None, 576, None, 0, pad_to_square=True)
    padded.check_image_size(16_000, 100)  # 160:1, a 256 M pixel square
    with pytest.raises(BadImage, match="padded to a square"):
        padded.check_image_size(20_000, 100)
    LlavaPromptProcessor(None, 576, 32000, 32000).check_image_size(20_000, 100)  # llava-hf does not pad


def test_qwen_vl_resizes_any_aspect_to_its_square(tmp_path):
    """Qwen-VL's transform resizes straight to 448x448: 1x4000 is served, so its processor checks nothing."""
    assert not family("QWenLMHeadModel").checks_image_size
    assert not hasattr(QwenVLPromptProcessor, "check_image_size")
    preprocessor = QwenVLVisionModel.load_preprocessor(build_qwen_vl(str(tmp_path)))
    for width, height in EXTREME:
        buf = io.BytesIO()
        Image.new("RGB", (width, height), (10, 20, 30)).save(buf, "PNG")
        assert decode_and_preprocess(buf.getvalue(), preprocessor).num_tokens == 256
