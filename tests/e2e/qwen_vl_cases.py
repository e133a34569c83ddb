"""What the Qwen-VL families' server tests share (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the checkpoint, server and HF
reference as module fixtures, the /generate requests (1 image, 2 images of different non-square sizes, text only)
and the checks over HTTP against HF's greedy tokens. Each family's test module keeps what is its own (its checkpoint,
server flags, chat-template quirks, extra cases)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import E2E_DEVICE, ServerProcess, serving
from tests.models.hf_reference import Greedy, hf_greedy, matches_greedy
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

NEW_TOKENS = 20
ENCODED = "mmserve_images_encoded_total"

CASES = [
    (CHAT.format(VISION + "Describe this picture."), [picture(150, 100, 1)]),
    (CHAT.format(f"{VISION}and{VISION}Compare the two cities."), [picture(60, 200, 2), picture(333, 77, 3)]),
    (CHAT.format("What is AI?"), []),
]


def server_fixtures(family: QwenVLFamily, *server_args: str):
    """Module fixtures `model_dir` (the tiny checkpoint in a folder named family.name, the name /v1/models reports),
    `server` (the real server on it, --enable_multimodal plus `server_args`) and `hf` (HF's greedy tokens for
    (text, images[, new_tokens]), with `.tokenizer`); a test module binds them under those names."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> str:
        return family.build(str(tmp_path_factory.mktemp(family.name) / family.name))

    @pytest.fixture(scope="module")
    def server(model_dir, tmp_path_factory):
        srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                            "4096", "--enable_multimodal", *server_args)  # fmt: skip
        with serving(srv):
            yield srv

    @pytest.fixture(scope="module")
    def hf(model_dir):
        return hf_greedy_for(family, model_dir)

    return model_dir, server, hf


def hf_greedy_for(family: QwenVLFamily, model_dir: str) -> Callable[..., list[int]]:
    """HF's greedy tokens for (text, images[, new_tokens]) on the checkpoint, with `.tokenizer`."""
    model = family.hf_model(model_dir)
    processor = family.hf_processor(model_dir)

    def greedy(text: str, images: list[Image.Image], new_tokens: int = NEW_TOKENS) -> Greedy:
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


def assert_equals_hf(ours: list[int], ref: Greedy) -> None:
    """HF's tokens: exactly on a CPU server (HF's arithmetic); on a GPU server HF's up to a float32 tie that the GPU
    broke the other way (`matches_greedy`)."""
    assert matches_greedy(ours, ref, exact=E2E_DEVICE == "cpu"), (ours, list(ref), ref.gap)


def check_concurrent_generate_equals_hf(server, hf) -> list[list[int]]:
    """CASES at once (batched in the engine with the text-only request): HF's tokens, each image encoded once; the
    first request again: a cache hit, not a new encoding, and the same answer. Returns our answers."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        ours = list(pool.map(lambda case: generate(server, *case), CASES))
    assert all(len(ids) == NEW_TOKENS for ids in ours)
    for answer, case in zip(ours, CASES, strict=True):
        assert_equals_hf(answer, hf(*case))
    assert server.metrics()[ENCODED] == 3

    assert generate(server, *CASES[0]) == ours[0]
    assert server.metrics()[ENCODED] == 3
    return ours


def check_chat_completions_equal_hf(server, hf, model: str, template_ok: Callable[[str], bool]) -> None:
    """Two images in one user turn, through /v1/chat/completions: the server renders the checkpoint's chat template
    (HF's rendering of it passes `template_ok`) and answers HF's greedy text."""
    images = [picture(90, 130, 4), picture(200, 70, 5)]
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(im)}} for im in images]
    content.append({"type": "text", "text": "Compare these."})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare these."}]}
    ]
    text = hf.tokenizer.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    assert template_ok(text), text
    ids = hf(text, images)
    reply = r.json()
    assert reply["choices"][0]["message"]["content"] == hf.tokenizer.decode(ids, skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS
