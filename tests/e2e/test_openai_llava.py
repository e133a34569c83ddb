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
from tests.e2e.server_proc import ServerProcess, serving
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
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)

    def greedy(turns: list) -> tuple[str, int, str, list[int]]:
        """HF's greedy text, prompt length, rendered prompt and greedy ids on the built-in template, rendered by
        apply_chat_template."""
        messages, images = hf_messages(turns)
        text = processor.tokenizer.apply_chat_template(
            messages, chat_template=LLAVA_1_5, tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        prompt_ids = inputs["input_ids"][0].tolist()
        ids = hf_greedy(model, prompt_ids, NEW_TOKENS, pixel_values=inputs["pixel_values"])
        return processor.tokenizer.decode(ids, skip_special_tokens=True), len(prompt_ids), text, ids

    return greedy


@pytest.mark.parametrize("turns", [ONE_IMAGE, MULTI_TURN], ids=["one_image", "multi_turn_two_images"])
def test_chat_equals_hf_greedy_on_the_builtin_template(client, hf, turns):
    text, prompt_len, rendered, _ = hf(turns)
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


def kwargs_of(turns: list, **kw) -> dict:
    return dict(model=MODEL, messages=openai_messages(turns), max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True},
                **kw)  # fmt: skip


def test_n_choices_greedy_equal_hf_and_sampled_follow_the_seeds(client, hf):
    text, prompt_len, _, _ = hf(ONE_IMAGE)
    reply = client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, n=3))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [text] * 3
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, 3 * NEW_TOKENS)

    sampled = client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=1.0, seed=11, n=2))
    alone = [client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=1.0, seed=11 + i)) for i in range(2)]
    assert [c.message.content for c in sampled.choices] == [a.choices[0].message.content for a in alone]

    chunks = list(client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=1.0, seed=11, n=2, stream=True,
                                                             stream_options={"include_usage": True})))  # fmt: skip
    for index in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == sampled.choices[index].message.content
    assert chunks[-1].usage.completion_tokens == 2 * NEW_TOKENS

    completions = client.completions.create(model=MODEL, prompt="What is AI?", n=2, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in completions.choices] == [0, 1] and completions.usage.completion_tokens == 10
    assert completions.choices[0].text == completions.choices[1].text


def hf_token_logprobs(model_dir: str, turns: list, prompt_len: int, reply_ids: list[int]) -> list[float]:
    """HF's log-probability of each generated token, from one forward pass over prompt + reply."""
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    messages, images = hf_messages(turns)
    text = processor.tokenizer.apply_chat_template(messages, chat_template=LLAVA_1_5, tokenize=False,
                                                   add_generation_prompt=True)  # fmt: skip
    inputs = processor(text=text, images=images, return_tensors="pt")
    ids = torch.tensor([inputs["input_ids"][0].tolist() + reply_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, prompt_len - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(reply_ids)[:, None])[:, 0].tolist()


def test_logprobs_are_each_chosen_tokens_own(client, model_dir, hf):
    text, prompt_len, _, ids = hf(ONE_IMAGE)
    reply = client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, logprobs=True, top_logprobs=0))
    content = reply.choices[0].logprobs.content
    assert len(content) == NEW_TOKENS and "".join(t.token for t in content) == text == reply.choices[0].message.content
    assert all(t.top_logprobs == [] and bytes(t.bytes) == t.token.encode() for t in content)

    expected = hf_token_logprobs(model_dir, ONE_IMAGE, prompt_len, ids)  # HF's greedy ids, which the server chose
    assert [t.logprob for t in content] == pytest.approx(expected, abs=2e-3)
    assert all(t.logprob <= 0 for t in content)

    chunks = list(client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, logprobs=True, stream=True)))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]  # logprobs: the prefix cache's rounding
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0)).choices[0].logprobs is None

    done = client.completions.create(model=MODEL, prompt="What is AI?", max_tokens=5, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    lp = done.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
        and "".join(lp.tokens) == done.choices[0].text
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_top_k_logprobs_are_refused_by_name(client):
    for call, param in [
        (lambda: client.chat.completions.create(**kwargs_of(ONE_IMAGE, logprobs=True, top_logprobs=3)), "top_logprobs"),
        (lambda: client.completions.create(model=MODEL, prompt="Hi", logprobs=2), "logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = info.value.response.json()["error"]
        assert error["param"] == param and "not supported yet" in error["message"], error
