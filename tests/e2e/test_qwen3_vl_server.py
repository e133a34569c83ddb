"""Issue 12's Qwen3-VL acceptance over HTTP: the real server (--enable_multimodal) on a tiny random Qwen3-VL in the
published layout (DeepStack rows in each image's cache entry, interleaved M-RoPE, the Instruct chat template) answers
concurrent /generate requests (1 image, 2 images of different non-square sizes, text only) with HF
Qwen3VLForConditionalGeneration's greedy tokens, also when prompts are prefilled in small chunks and when a repeated
image's KV comes from the prefix cache, and /v1/chat/completions with HF's greedy text on the checkpoint's own
template; repeated images are encoded once; video input gets a 400 that says it is not supported."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from mmserve.checkpoints.qwen3_vl import build_qwen3_vl
from tests.e2e.images import picture, png_b64
from tests.e2e.server_proc import ServerProcess, serving
from tests.models.hf_reference import hf_greedy

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
NEW_TOKENS = 20
ENCODED = "mmserve_images_encoded_total"
MODEL = "qwen3_vl"  # the model folder's name, as /v1/models reports it


CASES = [
    (CHAT.format(VISION + "Describe this picture."), [picture(150, 100, 1)]),
    (CHAT.format(f"{VISION}and{VISION}Compare the two cities."), [picture(60, 200, 2), picture(333, 77, 3)]),
    (CHAT.format("What is AI?"), []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3_vl") / MODEL)
    return build_qwen3_vl(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # Chunks of 16 prompt tokens: every image's rows (12 to 20 tokens here) are split across steps.
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--enable_multimodal", "--chunked_prefill_size", "16")  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def hf(model_dir):
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
                                 tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                 video_processor=Qwen3VLVideoProcessor())  # fmt: skip

    def greedy(text: str, images: list[Image.Image], new_tokens: int = NEW_TOKENS) -> list[int]:
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        return hf_greedy(model, inputs["input_ids"][0].tolist(), new_tokens, **extra)

    greedy.tokenizer = processor.tokenizer
    return greedy


def generate(server, prompt: str, images: list[Image.Image], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["tokens"]]


def test_concurrent_generate_equals_hf(server, hf):
    with ThreadPoolExecutor(len(CASES)) as pool:  # batched in the engine with the text-only request
        ours = list(pool.map(lambda case: generate(server, *case), CASES))
    assert all(len(ids) == NEW_TOKENS for ids in ours)
    assert ours == [hf(*case) for case in CASES]
    assert server.metrics()[ENCODED] == 3

    # The first request's image again: a cache hit (embedding and prefix KV), not a new encoding, the same answer.
    assert generate(server, *CASES[0]) == ours[0]
    assert server.metrics()[ENCODED] == 3
    # The same image behind a different question: its KV comes from the prefix cache, the rest is prefilled.
    text, images = CHAT.format(VISION + "What colour dominates?"), CASES[0][1]
    assert generate(server, text, images) == hf(text, images)


def test_chat_completions_equal_hf_on_the_published_template(server, hf):
    """Two images in one user turn, through /v1/chat/completions: the server renders the checkpoint's chat template
    (no default system turn, one vision block per image part) and answers HF's greedy text."""
    images = [picture(90, 130, 4), picture(200, 70, 5)]
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(im)}} for im in images]
    content.append({"type": "text", "text": "Compare these."})
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare these."}]}
    ]
    text = hf.tokenizer.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    assert text == CHAT.format(2 * VISION + "Compare these.")
    ids = hf(text, images)
    reply = r.json()
    assert reply["choices"][0]["message"]["content"] == hf.tokenizer.decode(ids, skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS


@pytest.mark.parametrize(
    "body, field",
    [
        ({"inputs": CHAT.format("<|vision_start|><|video_pad|><|vision_end|>What happens?")}, "inputs"),
        ({"inputs": CHAT.format("What happens?"), "multimodal_params": {"videos": [{"type": "base64", "data": ""}]}},
         "multimodal_params.videos"),
    ],
    ids=["video_placeholder", "videos_param"],
)  # fmt: skip
def test_video_input_gets_400(server, body, field):
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and "video input is not supported" in r.json()["error"]
    assert len(generate(server, *CASES[2], max_new_tokens=2)) == 2  # and the server keeps serving
