"""Issue 33 over HTTP: a tiny Qwen3-VL checkpoint in the published block-wise FP8 layout (Qwen3-VL-*-Instruct-FP8:
e4m3 decoder linears with 128x128 `weight_scale_inv`, `quantization_config.quant_method: fp8`) loads and serves
through the real server, with the vision tower in FP8 too (`--vit_quant_type fp8w8a8`): /generate and
/v1/chat/completions answer with images and without. Against HF on the unquantized weights (token embeddings scaled
up so that greedy choices have margins above FP8's noise, mmserve/testing/checkpoints/fp8.py), at the first
divergence of the greedy tokens ours is in HF's top 5 (both sides of that rule: tests/models/test_fp8.py)."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

from mmserve.testing.checkpoints.fp8 import quantize_checkpoint, scale_embeddings
from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl
from mmserve.testing.fidelity import TOP_K, first_divergence
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.e2e.qwen_vl_cases import generate
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

MODEL = "qwen3_vl_fp8"
FAMILY = QwenVLFamily(MODEL, "Qwen3VLForConditionalGeneration", build_qwen3_vl, Qwen3VLForConditionalGeneration,
                      Qwen3VLProcessor, Qwen3VLVideoProcessor)  # fmt: skip
NEW_TOKENS = 16
CASES = [(CHAT.format(VISION + "Describe this picture."), [picture(150, 100, 1)]), (CHAT.format("What is AI?"), [])]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> str:
    return scale_embeddings(build_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_bf16"))), 4.0)


@pytest.fixture(scope="module")
def server(bf16_dir, tmp_path_factory):
    fp8_dir = str(tmp_path_factory.mktemp("fp8") / MODEL)
    shutil.copytree(bf16_dir, fp8_dir)
    quantize_checkpoint(fp8_dir, "block")
    srv = ServerProcess(fp8_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", "2048",
                        "--enable_multimodal", "--vit_quant_type", "fp8w8a8", "--log_level", "info")  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def hf(bf16_dir):
    """(text, images) -> HF's greedy tokens and its top-k at each step, on the unquantized weights."""
    model, processor = FAMILY.hf_model(bf16_dir), FAMILY.hf_processor(bf16_dir)

    def greedy(text, images):
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        return tokens, [s[0].topk(TOP_K).indices.tolist() for s in out.scores]

    greedy.tokenizer = processor.tokenizer
    return greedy


def test_both_the_decoder_and_the_tower_run_fp8(server):
    with open(server.log_path) as f:
        log = f.read()
    assert "decoder linear layers: FP8 e4m3, the checkpoint's 128x128 weight blocks" in log
    assert "vision tower: 12 encoder-layer linears in FP8 e4m3" in log  # 3 blocks x (qkv, proj, fc1, fc2)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_generate_serves_the_fp8_checkpoint(server, hf, case):
    text, images = CASES[case]
    ours = generate(server, text, images, NEW_TOKENS)
    theirs, their_tops = hf(text, images)
    assert len(ours) == NEW_TOKENS
    i = first_divergence(ours, theirs)
    assert i is None or ours[i] in their_tops[i], (i, ours, theirs)


def test_chat_completions_serve_the_fp8_checkpoint(server, hf):
    image = picture(90, 130, 4)
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(image)}},
               {"type": "text", "text": "What is in it?"}]  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS
    theirs, _ = hf(CHAT.format(VISION + "What is in it?"), [image])
    ids = hf.tokenizer(reply["choices"][0]["message"]["content"], add_special_tokens=False).input_ids
    assert ids[:2] == theirs[:2]  # the answer starts as HF's (margins above the noise of FP8 tower and decoder)
