"""Issue 12's Qwen2.5-VL acceptance over HTTP: the real server (--enable_multimodal) on a tiny random Qwen2.5-VL in the
published layout (window attention in the tower, the Instruct chat template) answers concurrent /generate requests
(1 image, 2 images of different non-square sizes, text only) with HF Qwen2_5_VLForConditionalGeneration's greedy
tokens, and /v1/chat/completions with HF's greedy text on the checkpoint's own template; repeated images are encoded
once; video input (qwen_vl_video_cases) equals HF's, second_per_grid_ts on M-RoPE's time axis included."""

from __future__ import annotations

import pytest
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

from mmserve.testing.checkpoints.qwen2_5_vl import build_qwen2_5_vl
from tests.e2e import qwen_vl_cases as cases
from tests.e2e import qwen_vl_video_cases as video
from tests.models.qwen_vl_harness import VISION, QwenVLFamily

MODEL = "qwen2_5_vl"  # the model folder's name, as /v1/models reports it
FAMILY = QwenVLFamily(MODEL, "Qwen2_5_VLForConditionalGeneration", build_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration,
                      Qwen2_5_VLProcessor, Qwen2VLVideoProcessor)  # fmt: skip
# the video limits of qwen_vl_video_cases (SERVER_ARGS): its over-limit videos get 400s
model_dir, server, hf = cases.server_fixtures(FAMILY, *video.SERVER_ARGS)


@pytest.fixture(scope="module")
def hf_video(model_dir):
    return video.hf_video_greedy(FAMILY, model_dir)


def test_concurrent_generate_equals_hf(server, hf):
    cases.check_concurrent_generate_equals_hf(server, hf)


def test_chat_completions_equal_hf_on_the_published_template(server, hf):
    """The template has a default system turn and one vision block per image part."""
    cases.check_chat_completions_equal_hf(
        server, hf, MODEL, lambda text: text.startswith("<|im_start|>system\n") and text.count(VISION) == 2
    )


def test_video_generate_equals_hf(server, hf_video):
    """A clip, then a clip and an image in one prompt: HF's greedy tokens and prompt length."""
    video.check_generate_equals_hf(server, hf_video)


def test_two_turn_video_chat_equals_hf(server, hf_video):
    video.check_two_turn_chat_equals_hf(server, hf_video, FAMILY.name)


def test_bad_videos_get_400(server):
    video.check_bad_videos_get_400(server)
