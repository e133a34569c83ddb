"""The OpenAI chat API on the tiny LLaVA-1.5 checkpoint (llava-hf layout), which carries no chat template, so the
built-in LLaVA-1.5 one applies (mmserve/chat_templates.py): with the real `openai` client, the reply to a chat with
images equals HF transformers' greedy output on the same weights and the same rendered prompt, text and usage alike,
and the streamed pieces join to the non-streamed text."""

from __future__ import annotations

import os

import openai
import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from mmserve.chat_templates import LLAVA_1_5, LLAVA_SYSTEM_PROMPT
from mmserve.checkpoints.llava import build_llava_hf
from tests.e2e.server_proc import ServerProcess
from tests.e2e.test_openai_api import hf_messages, openai_messages, picture
from tests.models.hf_reference import hf_greedy

NEW_TOKENS = 12
MODEL = "llava-tiny"

ONE_IMAGE = [("user", [picture(150, 100, 1), "What is shown in this picture?"])]
MULTI_TURN = [
    ("user", [picture(60, 200, 2), "What is in this picture?"]),
    ("assistant", ["A tall city at night."]),
    ("user", ["And in this one?", picture(333, 77, 3)]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = build_llava_hf(str(tmp_path_factory.mktemp("openai_llava") / MODEL))
    assert AutoTokenizer.from_pretrained(path).chat_template is None  # the built-in template is what renders
    assert not os.path.exists(os.path.join(path, "chat_template.json"))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", "2048",
                        "--enable_multimodal")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()
        assert srv.leftover_children() == []


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)

    def greedy(turns: list) -> tuple[str, int, str]:
        """HF's greedy text and prompt length on the built-in template, rendered by apply_chat_template."""
        messages, images = hf_messages(turns)
        text = processor.tokenizer.apply_chat_template(
            messages, chat_template=LLAVA_1_5, tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        prompt_ids = inputs["input_ids"][0].tolist()
        ids = hf_greedy(model, prompt_ids, NEW_TOKENS, pixel_values=inputs["pixel_values"])
        return processor.tokenizer.decode(ids, skip_special_tokens=True), len(prompt_ids), text

    return greedy


@pytest.mark.parametrize("turns", [ONE_IMAGE, MULTI_TURN], ids=["one_image", "multi_turn_two_images"])
def test_chat_equals_hf_greedy_on_the_builtin_template(client, hf, turns):
    text, prompt_len, rendered = hf(turns)
    assert rendered.startswith(f"{LLAVA_SYSTEM_PROMPT} USER: <image>\n") and rendered.endswith(" ASSISTANT:")
    kwargs = dict(model=MODEL, messages=openai_messages(turns), max_tokens=NEW_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, NEW_TOKENS)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_len, NEW_TOKENS)
