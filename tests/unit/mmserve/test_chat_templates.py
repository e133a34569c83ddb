"""The built-in chat templates (mmserve/prep/chat_templates.py) for checkpoints without one, rendered by transformers'
apply_chat_template as the OpenAI routes render them: each family's published prompt format, exactly."""

from __future__ import annotations

import json

import pytest

from mmserve.http.openai_protocol import chat_messages, render_chat
from mmserve.http.protocol import BadRequest
from mmserve.prep.chat_templates import (
    LLAVA_1_5,
    LLAVA_SYSTEM_PROMPT,
    QWEN2_VL,
    QWEN3_VL,
    QWEN_VL_CHAT,
    builtin_chat_template,
    model_architecture,
)
from mmserve.testing.checkpoints.tokenizer import build_tokenizer

IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CONVERSATION = [
    {"role": "user", "content": [IMG, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A city."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "And these?"}, IMG, IMG, {"type": "text", "text": "Compare."}],
    },
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def render(tokenizer, template: str, raw: list[dict], **body) -> str:
    messages, images, _ = chat_messages(raw, None)
    assert len(images) == sum(1 for m in raw if isinstance(m["content"], list) for p in m["content"] if p is IMG)
    return render_chat(tokenizer, template, messages, body)


def test_llava_1_5_is_conv_vicuna_v1(tokenizer):
    expected = (
        f"{LLAVA_SYSTEM_PROMPT} USER: <image>\nWhat is this? ASSISTANT: A city.</s>"
        "USER: <image>\n<image>\nAnd these? Compare. ASSISTANT:"
    )
    assert render(tokenizer, LLAVA_1_5, CONVERSATION) == expected
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, LLAVA_1_5, with_system) == "Be brief. USER: Hi ASSISTANT:"
    assert render(tokenizer, LLAVA_1_5, with_system, add_generation_prompt=False) == "Be brief. USER: Hi "
    late_system = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"}]
    with pytest.raises(BadRequest, match="system message"):
        render(tokenizer, LLAVA_1_5, late_system)


def test_qwen_vl_chat_is_chatml_with_numbered_pictures(tokenizer):
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <img></img>\nWhat is this?<|im_end|>\n"
        "<|im_start|>assistant\nA city.<|im_end|>\n"
        "<|im_start|>user\nAnd these?Picture 2: <img></img>\nPicture 3: <img></img>\nCompare.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, QWEN_VL_CHAT, CONVERSATION) == expected


def test_qwen2_vl_is_the_published_chatml(tokenizer):
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{vision}What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA city.<|im_end|>\n"
        f"<|im_start|>user\nAnd these?{vision}{vision}Compare.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, QWEN2_VL, CONVERSATION) == expected


def test_qwen3_vl_is_the_published_template(tokenizer):
    """Qwen3-VL-*-Instruct's chat_template.json byte for byte (its SHA-256), rendering ChatML without a default system
    turn."""
    import hashlib

    assert hashlib.sha256(QWEN3_VL.encode()).hexdigest() == (
        "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
    )
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    expected = (
        f"<|im_start|>user\n{vision}What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA city.<|im_end|>\n"
        f"<|im_start|>user\nAnd these?{vision}{vision}Compare.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, QWEN3_VL, CONVERSATION) == expected
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, QWEN3_VL, with_system) == expected


@pytest.mark.parametrize(
    "architecture, template",
    [
        ("LlavaForConditionalGeneration", LLAVA_1_5),
        ("LlavaLlamaForCausalLM", LLAVA_1_5),
        ("QWenLMHeadModel", QWEN_VL_CHAT),
        ("Qwen2VLForConditionalGeneration", QWEN2_VL),
        ("Qwen2_5_VLForConditionalGeneration", QWEN2_VL),
        ("Qwen3VLForConditionalGeneration", QWEN3_VL),
        ("LlamaForCausalLM", None),
    ],
)
def test_the_family_picks_its_template(tmp_path, architecture, template):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert model_architecture(str(tmp_path)) == architecture
    assert builtin_chat_template(model_architecture(str(tmp_path))) == template
    assert model_architecture(str(tmp_path / "missing")) is None
