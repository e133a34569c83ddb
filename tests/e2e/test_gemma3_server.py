"""Issue 31's Gemma 3 acceptance over HTTP, on a tiny random checkpoint in google's published layout with its chat
template: the real server answers concurrent /generate requests (one image, two images of different sizes, text only)
and /v1/chat/completions (one image, a two-turn chat with an image in each user turn) with HF transformers' greedy
tokens, its prompt token counts equal Gemma3Processor's, and a repeated turn reuses the prefix cache across its images
(whose tokens attend to each other both ways) with the same answer. The server prefills 8 tokens a step: the text
runs in chunks, each 16-token image whole in one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from mmserve.prep.chat_templates import GEMMA3
from mmserve.testing.checkpoints.gemma3 import build_gemma3
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.e2e.test_openai_api import hf_messages, openai_messages

NEW_TOKENS = 16
MODEL = "gemma3-tiny"
HITS = "mmserve_prefix_cache_hit_tokens_total"
CHAT = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
IMAGE = "<start_of_image>"
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_gemma3(str(tmp_path_factory.mktemp("gemma3") / MODEL))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--enable_multimodal", "--chunked_prefill_size", "8")  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


def hf_greedy(model, processor, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """(HF processor's prompt ids, HF's greedy new ids; the processor's token_type_ids give the image blocks)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0,
                             do_sample=False, top_k=None, top_p=None)  # fmt: skip
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf(model_dir, processor):
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return lambda text, images: hf_greedy(model, processor, text, images)


def generate(srv: ServerProcess, prompt: str, images: list[Image.Image]) -> dict:
    body = {"inputs": prompt,
            "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True},
            "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]}}  # fmt: skip
    r = httpx.post(srv.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_generate_equals_hf(server, hf):
    with ThreadPoolExecutor(len(GENERATE_CASES)) as pool:
        answers = list(pool.map(lambda case: generate(server, *case), GENERATE_CASES))
    for (text, images), answer in zip(GENERATE_CASES, answers, strict=True):
        prompt_ids, expected = hf(text, images)
        assert answer["prompt_tokens"] == len(prompt_ids), text
        assert [t["id"] for t in answer["tokens"]] == expected, text
    assert server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0) == 0


def chat(server: ServerProcess, turns: list) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    return client.chat.completions.create(model=MODEL, messages=openai_messages(turns), max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})  # fmt: skip


@pytest.mark.parametrize("turns", [ONE_IMAGE, TWO_TURNS], ids=["one_image", "two_turns"])
def test_chat_equals_hf_on_the_published_template(server, hf, processor, turns):
    messages, images = hf_messages(turns)
    rendered = processor.apply_chat_template(messages, chat_template=GEMMA3, add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\n")
    prompt_ids, expected = hf(rendered.removeprefix("<bos>"), images)  # the processor adds the BOS itself
    reply = chat(server, turns)
    assert reply.choices[0].message.content == processor.tokenizer.decode(expected, skip_special_tokens=True)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), NEW_TOKENS)


def test_repeated_turn_reuses_the_prefix_cache(server):
    """The same two-turn chat again: all of its prompt but the last token comes from the cache, both images' blocks
    included, and the answer is the same as the one computed from scratch."""
    first = chat(server, TWO_TURNS)
    hits = server.metrics()[HITS]
    again = chat(server, TWO_TURNS)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert server.wait_metric(HITS, lambda v: v > hits) == hits + again.usage.prompt_tokens - 1
