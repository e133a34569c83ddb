"""Issue 33's quantized KV cache over HTTP: the real server (--device cpu, --enable_multimodal) on a tiny random
Qwen2-VL with --llm_kv_type int8kv answers /generate with an image as HF transformers does, under the rule for
quantized serving (where greedy tokens first differ, ours is among HF's 5 most likely), and a repeated prompt is
served from the prefix cache over the quantized slots with the same answer."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor

from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

FAMILY = QwenVLFamily("qwen2_vl", "Qwen2VLForConditionalGeneration", build_qwen2_vl, Qwen2VLForConditionalGeneration,
                      Qwen2VLProcessor, Qwen2VLVideoProcessor)  # fmt: skip
NEW_TOKENS = 20
TOP = 5
PROMPT = CHAT.format(VISION + "Describe this picture.")
HITS = "mmserve_prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return FAMILY.build(str(tmp_path_factory.mktemp(FAMILY.name) / FAMILY.name))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = ServerProcess(
        model_dir, log, "--max_total_token_num", "4096", "--enable_multimodal", "--llm_kv_type", "int8kv"
    )
    with serving(srv):
        yield srv


def generate(server, images) -> dict:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def hf_top(model, processor, images, continuation: list[int]) -> list[list[int]]:
    """HF's 5 most likely tokens after the prompt and each prefix of `continuation` (teacher-forced, one forward)."""
    inputs = processor(text=[PROMPT], images=images, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    tail = torch.tensor([continuation])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], tail], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "mm_token_type_ids" in inputs:  # text after the prompt
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], dim=1)
    with torch.no_grad():
        logits = model(**inputs).logits[0, prompt_len - 1 :]  # [len(continuation) + 1, vocab]
    return logits.topk(TOP, dim=-1).indices.tolist()


def test_image_generate_meets_the_top5_rule_and_repeats_from_the_prefix_cache(server, model_dir):
    model, processor = FAMILY.hf_model(model_dir), FAMILY.hf_processor(model_dir)
    images = [picture(150, 100, 1)]
    first = generate(server, images)
    ours = [t["id"] for t in first["tokens"]]
    assert len(ours) == NEW_TOKENS
    tops = hf_top(model, processor, images, ours)
    # HF's greedy token after our prefix is its top-1 there: where it first differs from ours, ours is in its top 5.
    diverged = next((i for i, top in enumerate(tops[:NEW_TOKENS]) if top[0] != ours[i]), None)
    if diverged is not None:
        assert ours[diverged] in tops[diverged], (diverged, ours[diverged], tops[diverged])
    assert diverged is None or diverged >= NEW_TOKENS // 2, f"int8 KV drifted from HF at token {diverged}"

    hits = server.metrics()[HITS]
    again = generate(server, images)
    assert again["prompt_cache_len"] > 0 and server.metrics()[HITS] > hits
    assert [t["id"] for t in again["tokens"]] == ours
