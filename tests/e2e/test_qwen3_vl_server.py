"""Issue 12's Qwen3-VL acceptance over HTTP: the real server (--enable_multimodal) on a tiny random Qwen3-VL in the
published layout (DeepStack rows in each image's cache entry, interleaved M-RoPE, the Instruct chat template) answers
concurrent /generate requests (1 image, 2 images of different non-square sizes, text only) with HF
Qwen3VLForConditionalGeneration's greedy tokens, also when prompts are prefilled in small chunks and when a repeated
image's KV comes from the prefix cache, and /v1/chat/completions with HF's greedy text on the checkpoint's own
template; repeated images are encoded once. Video (qwen_vl_video_cases): greedy tokens and prompt token counts equal
HF's with Qwen3VLVideoProcessor's sampling and resize, Qwen3VLProcessor's `<t seconds>` before each temporal patch,
each patch a separate run on M-RoPE and DeepStack rows for the video's frames; a video with an image; a two-turn chat
repeating the video; bad videos get a 400."""

from __future__ import annotations

import pytest
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl
from tests.e2e import qwen_vl_cases as cases
from tests.e2e import qwen_vl_video_cases as video
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

MODEL = "qwen3_vl"  # the model folder's name, as /v1/models reports it
FAMILY = QwenVLFamily(MODEL, "Qwen3VLForConditionalGeneration", build_qwen3_vl, Qwen3VLForConditionalGeneration,
                      Qwen3VLProcessor, Qwen3VLVideoProcessor)  # fmt: skip
# Chunks of 16 prompt tokens: every image's rows (12 to 20 tokens here) are split across steps.
# the video limits of qwen_vl_video_cases (SERVER_ARGS): its over-limit videos get 400s
model_dir, server, hf = cases.server_fixtures(FAMILY, "--chunked_prefill_size", "16", *video.SERVER_ARGS)
# Qwen3-VL bounds the pixels of all sampled frames together: 6 frames of the test clip resized to 64x96 (6 tokens each)
VIDEO_MAX_PIXELS = 32 * 32 * 6 * 8


def test_concurrent_generate_equals_hf(server, hf):
    """Also the repeated image's prefix KV: its second request and a different question behind it."""
    cases.check_concurrent_generate_equals_hf(server, hf)
    # The same image behind a different question: its KV comes from the prefix cache, the rest is prefilled.
    text, images = CHAT.format(VISION + "What colour dominates?"), cases.CASES[0][1]
    cases.assert_equals_hf(cases.generate(server, text, images), hf(text, images))


def test_chat_completions_equal_hf_on_the_published_template(server, hf):
    """The template has no default system turn, one vision block per image part."""
    expected = CHAT.format(2 * VISION + "Compare these.")
    cases.check_chat_completions_equal_hf(server, hf, MODEL, lambda text: text == expected)


@pytest.fixture(scope="module")
def hf_video(model_dir):
    return video.hf_video_greedy(FAMILY, model_dir, VIDEO_MAX_PIXELS)


def test_video_generate_equals_hf(server, hf_video):
    video.check_generate_equals_hf(server, hf_video)


def test_two_turn_video_chat_equals_hf(server, hf_video):
    video.check_two_turn_chat_equals_hf(server, hf_video, MODEL)


def test_bad_videos_get_400(server):
    video.check_bad_videos_get_400(server)
