"""Issue 5's Qwen2-VL acceptance over HTTP: the real server (--enable_multimodal) on a tiny random Qwen2-VL in the
published layout answers concurrent /generate requests (1 image, 2 images of different non-square sizes, text only)
with HF Qwen2VLForConditionalGeneration's greedy tokens; repeated and concurrent images are encoded once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from mmserve.checkpoints.qwen2_vl import build_qwen2_vl
from tests.e2e.images import picture, png_b64
from tests.e2e.server_proc import ServerProcess, serving
from tests.models.hf_reference import hf_greedy

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
NEW_TOKENS = 20
ENCODED = "mmserve_images_encoded_total"


CASES = [
    (CHAT.format(VISION + "Describe this picture."), [picture(150, 100, 1)]),
    (CHAT.format(f"{VISION}and{VISION}Compare the two cities."), [picture(60, 200, 2), picture(333, 77, 3)]),
    (CHAT.format("What is AI?"), []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--enable_multimodal")  # fmt: skip
    with serving(srv):
        yield srv


def generate(server, prompt: str, images: list[Image.Image], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["tokens"]]


def hf_tokens(model_dir: str) -> list[list[int]]:
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
                                 tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                 video_processor=Qwen2VLVideoProcessor())  # fmt: skip
    answers = []
    for text, images in CASES:
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        answers.append(hf_greedy(model, inputs["input_ids"][0].tolist(), NEW_TOKENS, **extra))
    return answers


def test_concurrent_generate_equals_hf(server, model_dir):
    with ThreadPoolExecutor(len(CASES)) as pool:  # batched in the engine with the text-only request
        ours = list(pool.map(lambda case: generate(server, *case), CASES))
    assert all(len(ids) == NEW_TOKENS for ids in ours)
    assert ours == hf_tokens(model_dir)
    assert server.metrics()[ENCODED] == 3

    # The first request's image again: a cache hit, not a new encoding, and the same answer.
    assert generate(server, *CASES[0]) == ours[0]
    assert server.metrics()[ENCODED] == 3


def test_concurrent_requests_sharing_a_new_image_encode_it_once(server):
    before = server.metrics()[ENCODED]
    prompt, image = CHAT.format(VISION + "What is this?"), picture(90, 130, 7)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: generate(server, prompt, [image], 4), range(4)))
    assert all(a == answers[0] for a in answers)
    assert server.metrics()[ENCODED] == before + 1
