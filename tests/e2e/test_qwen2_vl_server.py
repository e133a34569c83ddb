"""Issue 5's Qwen2-VL acceptance over HTTP: the real server (--enable_multimodal) on a tiny random Qwen2-VL in the
published layout answers concurrent /generate requests (1 image, 2 images of different non-square sizes, text only)
with HF Qwen2VLForConditionalGeneration's greedy tokens; repeated and concurrent images are encoded once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor

from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.images import picture
from tests.e2e import qwen_vl_cases as cases
from tests.e2e import qwen_vl_video_cases as video
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

FAMILY = QwenVLFamily("qwen2_vl", "Qwen2VLForConditionalGeneration", build_qwen2_vl, Qwen2VLForConditionalGeneration,
                      Qwen2VLProcessor, Qwen2VLVideoProcessor)  # fmt: skip
# the video limits of qwen_vl_video_cases (SERVER_ARGS): its over-limit videos get 400s
model_dir, server, hf = cases.server_fixtures(FAMILY, *video.SERVER_ARGS)


@pytest.fixture(scope="module")
def hf_video(model_dir):
    return video.hf_video_greedy(FAMILY, model_dir)


def test_concurrent_generate_equals_hf(server, hf):
    cases.check_concurrent_generate_equals_hf(server, hf)


def test_concurrent_requests_sharing_a_new_image_encode_it_once(server):
    before = server.metrics()[cases.ENCODED]
    prompt, image = CHAT.format(VISION + "What is this?"), picture(90, 130, 7)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: cases.generate(server, prompt, [image], 4), range(4)))
    assert all(a == answers[0] for a in answers)
    assert server.metrics()[cases.ENCODED] == before + 1


def test_video_generate_equals_hf(server, hf_video):
    """A clip, then a clip and an image in one prompt: HF's greedy tokens and prompt length."""
    video.check_generate_equals_hf(server, hf_video)


def test_two_turn_video_chat_equals_hf(server, hf_video):
    video.check_two_turn_chat_equals_hf(server, hf_video, FAMILY.name)


def test_bad_videos_get_400(server):
    video.check_bad_videos_get_400(server)


def test_video_sampling_is_part_of_the_cache_key(server):
    """fps, num_frames, min/max pixels each make another entry (the key's code is every family's: checked here)."""
    video.check_sampling_is_part_of_the_cache_key(server)
