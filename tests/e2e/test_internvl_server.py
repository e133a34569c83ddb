"""Issue 31's InternVL acceptance over HTTP, on tiny random checkpoints in both published layouts: the -hf one
(`InternVLForConditionalGeneration`, with its published chat template) and the remote-code one (`InternVLChatModel`,
`<image>` prompts, the family's built-in `internvl2_5` template), the latter with a Qwen2 language model (InternVL3)
and with InternLM2 (InternVL2.5-8B: packed `wqkv`, a sentencepiece tokenizer behind remote code, served with
--trust_remote_code); HF's reference for the remote-code layout is InternVLForConditionalGeneration on the same
weights in the -hf layout, which its builder writes beside it. The real server answers concurrent /generate
requests (one image, two images of different tile counts, text only, LightLLM's per-request tile cap
`image_max_patch_num`) and /v1/chat/completions (one image, a two-turn chat with an image in each user turn) with HF
transformers' greedy tokens, and its prompt token counts equal InternVLProcessor's. The server prefills 32 tokens a
step, so every image (16 to 112 rows here) spans chunks."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers
from packaging.version import Version
from PIL import Image
from transformers import AutoProcessor, InternVLForConditionalGeneration

from mmserve.prep.chat_templates import INTERNVL, INTERNVL_CHAT
from mmserve.testing.checkpoints.internvl import build_internvl_hf
from mmserve.testing.checkpoints.internvl_chat import build_internvl_chat
from mmserve.testing.checkpoints.internvl_internlm2 import build_internvl_internlm2
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.e2e.test_openai_api import hf_messages, openai_messages
from tests.models.hf_reference import hf_greedy
from visual.models.internvl import MIN_TRANSFORMERS

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version(MIN_TRANSFORMERS),
    reason=f"InternVL needs transformers >= {MIN_TRANSFORMERS}",
)

NEW_TOKENS = 16
ENCODED = "mmserve_images_encoded_total"
MODEL = "internvl-tiny"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
IMAGE_CONTEXT = "<IMG_CONTEXT>"
IMAGE = IMAGE_CONTEXT + "\n"
GENERATE_CASES = [
    (CHAT.format(IMAGE + "Describe this picture."), [picture(150, 100, 1)]),
    (CHAT.format(IMAGE + IMAGE + "Compare the two cities."), [picture(60, 200, 2), picture(333, 77, 3)]),
    (CHAT.format("What is AI?"), []),
]
ONE_IMAGE = [("user", [picture(150, 100, 1), "What is shown in this picture?"])]
TWO_TURNS = [
    ("user", [picture(60, 200, 2), "What is in this picture?"]),
    ("assistant", ["A tall city at night."]),
    ("user", [picture(333, 77, 3), "And in this one?"]),
]


REMOTE_CODE_LAYOUTS = ("remote_code", "internlm2")


@pytest.fixture(scope="module", params=["hf", "remote_code", "internlm2"])
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(layout, tmp_path_factory) -> str:
    if layout == "remote_code":
        return build_internvl_chat(str(tmp_path_factory.mktemp("internvl_chat") / MODEL))
    if layout == "internlm2":
        return build_internvl_internlm2(str(tmp_path_factory.mktemp("internvl_internlm2") / MODEL))
    path = build_internvl_hf(str(tmp_path_factory.mktemp("internvl") / MODEL))
    with open(os.path.join(path, "chat_template.json")) as f:
        assert json.load(f) == {"chat_template": INTERNVL}
    return path


def request_text(layout: str, hf_text: str) -> str:
    """What the server gets for a prompt HF's processor takes: the remote-code layout's placeholder is `<image>`."""
    return hf_text.replace(IMAGE_CONTEXT, "<image>") if layout in REMOTE_CODE_LAYOUTS else hf_text


@pytest.fixture(scope="module")
def hf_dir(layout, model_dir) -> str:
    return model_dir + "-hf" if layout in REMOTE_CODE_LAYOUTS else model_dir


@pytest.fixture(scope="module")
def server(layout, model_dir, tmp_path_factory):
    remote_code = ["--trust_remote_code"] if layout == "internlm2" else []  # InternLM2's tokenizer is remote code
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--enable_multimodal", "--chunked_prefill_size", "32", *remote_code)  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def processor(hf_dir):
    return AutoProcessor.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def hf(hf_dir, processor):
    model = InternVLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def greedy(text: str, images: list[Image.Image], **images_kwargs) -> tuple[list[int], list[int]]:
        """(HF processor's prompt ids, HF's greedy new ids)."""
        inputs = processor(text=text, images=images or None, return_tensors="pt", **images_kwargs)
        prompt = inputs["input_ids"][0].tolist()
        pixels = {"pixel_values": inputs["pixel_values"]} if images else {}
        return prompt, hf_greedy(model, prompt, NEW_TOKENS, **pixels)

    return greedy


def generate(srv: ServerProcess, prompt: str, images: list[Image.Image], **parameters) -> dict:
    body = {"inputs": prompt,
            "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True, **parameters},
            "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]}}  # fmt: skip
    r = httpx.post(srv.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_generate_equals_hf(layout, server, hf, processor):
    tiles = [processor.image_processor.get_number_of_image_patches(im.height, im.width, {"crop_to_patches": True})
             for _, images in GENERATE_CASES for im in images]  # fmt: skip
    assert len(set(tiles)) == 3, tiles  # three images, three tile counts
    with ThreadPoolExecutor(len(GENERATE_CASES)) as pool:
        answers = list(pool.map(lambda case: generate(server, request_text(layout, case[0]), case[1]), GENERATE_CASES))
    for (text, images), answer in zip(GENERATE_CASES, answers, strict=True):
        prompt_ids, expected = hf(text, images)
        assert answer["prompt_tokens"] == len(prompt_ids), text
        assert [t["id"] for t in answer["tokens"]] == expected, text
    assert server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0) == 0


@pytest.mark.parametrize("layout", ["hf"], indirect=True)  # the remote-code layout's cap: tests/models
def test_image_max_patch_num_caps_the_tiles_as_hf_max_patches(layout, server, hf, processor):
    """LightLLM's per-request cap is HF's `max_patches`: prompt, tiles and tokens follow it; an image under another
    cap is another cache entry (encoded again), under the same cap the same one."""
    text, image = CHAT.format(IMAGE + "Describe this picture."), picture(150, 100, 9)
    default_tiles = processor.image_processor.get_number_of_image_patches(100, 150, {"crop_to_patches": True})
    assert default_tiles > 3  # a cap of 2 tiles (+ the thumbnail) changes it
    encoded = [server.metrics()[ENCODED]]
    answers = {}
    for cap in (-1, 2, 2, -1, 0):
        answers[cap] = generate(server, request_text(layout, text), [image], image_max_patch_num=cap)
        encoded.append(server.metrics()[ENCODED])
    assert [b - a for a, b in zip(encoded, encoded[1:], strict=False)] == [1, 1, 0, 0, 1]
    for cap, answer in answers.items():
        prompt_ids, expected = hf(text, [image], **({} if cap == -1 else {"max_patches": cap}))
        assert answer["prompt_tokens"] == len(prompt_ids), cap
        assert [t["id"] for t in answer["tokens"]] == expected, cap
    assert answers[2]["prompt_tokens"] == answers[-1]["prompt_tokens"] - (default_tiles - 3) * 16
    assert answers[0]["prompt_tokens"] == answers[-1]["prompt_tokens"] - (default_tiles - 1) * 16


@pytest.mark.parametrize("turns", [ONE_IMAGE, TWO_TURNS], ids=["one_image", "two_turns"])
def test_chat_equals_hf_on_the_layouts_template(layout, server, hf, processor, turns):
    """The -hf layout's published template, or the remote-code layout's built-in one (its `<image>` given to HF's
    processor as `<IMG_CONTEXT>`)."""
    messages, images = hf_messages(turns)
    template = INTERNVL_CHAT if layout in REMOTE_CODE_LAYOUTS else INTERNVL
    rendered = processor.apply_chat_template(messages, chat_template=template, add_generation_prompt=True)
    rendered = rendered.replace("<image>", IMAGE_CONTEXT)
    assert rendered.startswith("<|im_start|>system\n" if layout in REMOTE_CODE_LAYOUTS else "<|im_start|>user\n")
    prompt_ids, expected = hf(rendered, images)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    reply = client.chat.completions.create(model=MODEL, messages=openai_messages(turns), max_tokens=NEW_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.choices[0].message.content == processor.tokenizer.decode(expected, skip_special_tokens=True)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), NEW_TOKENS)
