"""The OpenAI chat API on the tiny LLaVA-1.5 checkpoint (llava-hf layout) carrying llava-hf/llava-1.5-7b-hf's
published chat_template.json: with the real `openai` client, the reply to a chat with images equals HF transformers'
greedy output on the same weights and the prompt HF's processor.apply_chat_template renders, text and usage alike,
and the streamed pieces join to the non-streamed text. Log-probabilities equal HF's log-softmax: each chosen token's,
its top_logprobs alternatives, and the prompt's (completions' echo, /generate's prompt_logprobs with an image). The
server prefills 16 prompt tokens per step, so every prompt here (an image is 16 rows) spans several chunks."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from mmserve.http.openai_protocol import find_chat_template, render_chat
from mmserve.testing.checkpoints.llava import LLAVA_HF_CHAT_TEMPLATE, build_llava_hf
from mmserve.testing.images import png_b64
from mmserve.testing.server_proc import ServerProcess, serving
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
    with open(os.path.join(path, "chat_template.json"), "rb") as f:
        published = f.read()
    assert published == json.dumps({"chat_template": LLAVA_HF_CHAT_TEMPLATE}, indent=2).encode()
    assert len(published) == 700  # the size of llava-hf/llava-1.5-7b-hf's file
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", "2048",
                        "--enable_multimodal", "--chunked_prefill_size", "16")  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


def hf_inputs(processor, turns: list) -> tuple[str, dict]:
    """The prompt HF's processor renders from the checkpoint's template, and its model inputs."""
    messages, images = hf_messages(turns)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return text, processor(text=text, images=images or None, return_tensors="pt")


@pytest.fixture(scope="module")
def hf(hf_model, processor):
    def greedy(turns: list) -> tuple[str, int, str, list[int]]:
        """HF's greedy text, prompt length, rendered prompt and greedy ids."""
        text, inputs = hf_inputs(processor, turns)
        prompt_ids = inputs["input_ids"][0].tolist()
        ids = hf_greedy(hf_model, prompt_ids, NEW_TOKENS, pixel_values=inputs["pixel_values"])
        return processor.tokenizer.decode(ids, skip_special_tokens=True), len(prompt_ids), text, ids

    return greedy


def hf_log_softmax(hf_model, ids: list[int], pixel_values=None) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-softmax of HF's logits after token i."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_the_server_renders_what_hf_processor_renders(model_dir, processor):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = find_chat_template(tokenizer, model_dir)
    assert template == LLAVA_HF_CHAT_TEMPLATE
    for turns in (ONE_IMAGE, MULTI_TURN):
        messages = hf_messages(turns)[0]
        ours = render_chat(tokenizer, template, messages, {})
        assert ours == processor.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.startswith("USER: <image>\nWhat is in this picture? ASSISTANT: A tall city at night. USER: ")
    # a plain string content is one text part, as vLLM passes it to templates that loop over the parts
    plain = render_chat(tokenizer, template, [{"role": "user", "content": "Hi"}], {})
    assert plain == "USER: Hi ASSISTANT:"


@pytest.mark.parametrize("turns", [ONE_IMAGE, MULTI_TURN], ids=["one_image", "multi_turn_two_images"])
def test_chat_equals_hf_greedy_on_the_published_template(client, hf, turns):
    text, prompt_len, rendered, _ = hf(turns)
    assert rendered.startswith("USER: <image>\n") and rendered.endswith(" ASSISTANT:")
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


def test_logprobs_and_top_logprobs_equal_hf_log_softmax(client, hf_model, processor, hf):
    text, prompt_len, _, ids = hf(ONE_IMAGE)
    _, inputs = hf_inputs(processor, ONE_IMAGE)
    table = hf_log_softmax(hf_model, inputs["input_ids"][0].tolist() + ids, inputs["pixel_values"])
    table = table[prompt_len - 1 : -1]  # [NEW_TOKENS, vocab]: the distribution each reply token was chosen from
    reply = client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, logprobs=True, top_logprobs=5))
    content = reply.choices[0].logprobs.content
    assert len(content) == NEW_TOKENS and "".join(t.token for t in content) == text == reply.choices[0].message.content
    assert [t.logprob for t in content] == pytest.approx(table.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist(),
                                                         abs=2e-3)  # fmt: skip
    values, top_ids = table.topk(5, dim=-1)
    for step, t in enumerate(content):
        assert bytes(t.bytes) == t.token.encode() and len(t.top_logprobs) == 5
        assert [a.token for a in t.top_logprobs] == [processor.tokenizer.decode([i]) for i in top_ids[step].tolist()]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(values[step].tolist(), abs=2e-3)
        assert all(bytes(a.bytes) == a.token.encode() for a in t.top_logprobs)
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)  # greedy: the chosen one leads

    chunks = list(client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, logprobs=True, top_logprobs=5,
                                                             stream=True)))  # fmt: skip
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]  # logprobs: the prefix cache's rounding
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [[a.token for a in t.top_logprobs] for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    own = client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0, logprobs=True, top_logprobs=0))
    assert all(t.top_logprobs == [] for t in own.choices[0].logprobs.content)
    assert client.chat.completions.create(**kwargs_of(ONE_IMAGE, temperature=0)).choices[0].logprobs is None


def test_completions_logprobs_and_echo_score_the_prompt_as_hf(client, hf_model, processor):
    prompt = "What is AI? Tell me in a few words."
    prompt_ids = processor.tokenizer(prompt).input_ids
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    done = client.completions.create(**kwargs)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(lp.tokens[i] in top and len(top) >= 2 for i, top in enumerate(lp.top_logprobs))

    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == prompt + done.choices[0].text
    elp = echoed.choices[0].logprobs
    n = len(prompt_ids)
    assert elp.tokens[n:] == lp.tokens and elp.token_logprobs[n:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert elp.tokens[:n] == [processor.tokenizer.decode([i]) for i in prompt_ids]
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    table = hf_log_softmax(hf_model, prompt_ids)[:-1]
    expected = table.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()
    assert elp.token_logprobs[1:n] == pytest.approx(expected, abs=2e-3)
    values, top_ids = table.topk(2, dim=-1)
    for i in range(1, n):  # alternatives keyed by text: tokens that decode alike (partial bytes) share a key
        texts = [processor.tokenizer.decode([t]) for t in top_ids[i - 1].tolist()]
        alternatives = {t: v for t, v in zip(texts, values[i - 1].tolist(), strict=True) if texts.count(t) == 1}
        top = elp.top_logprobs[i]
        assert {t: top[t] for t in alternatives} == pytest.approx(alternatives, abs=2e-3), (i, top, alternatives)
    assert elp.text_offset == [sum(len(t) for t in elp.tokens[:i]) for i in range(len(elp.tokens))]

    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt  # the prompt comes first
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert (
        client.completions.create(**{**kwargs, "logprobs": None}, echo=True).choices[0].text == echoed.choices[0].text
    )


def test_generate_prompt_logprobs_with_an_image_equal_hf_forward_logits(server, hf_model, processor):
    """LightLLM's shape: prompt_token_ids and one [token_id, {next_token_id: logprob, ...}] pair per position; the
    image's placeholder positions are scored too (the placeholder id's log-probability, as HF's logits give it)."""
    image = picture(150, 100, 4)
    prompt = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    prompt_ids = inputs["input_ids"][0].tolist()
    table = hf_log_softmax(hf_model, prompt_ids, inputs["pixel_values"])[:-1]
    values, top_ids = table.topk(3, dim=-1)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 2, "prompt_logprobs": 3},
            "multimodal_params": {"images": [{"type": "base64", "data": png_b64(image)}]}}  # fmt: skip
    for _ in range(2):  # the second time the prompt is cached, yet it is scored in full again
        out = httpx.post(server.url + "/generate", json=body, timeout=180).json()
        assert out["prompt_token_ids"] == prompt_ids and len(out["prompt_logprobs"]) == len(prompt_ids) - 1
        for i, (token, scores) in enumerate(out["prompt_logprobs"]):
            assert token == prompt_ids[i] and next(iter(scores)) == str(prompt_ids[i + 1])
            assert scores[str(prompt_ids[i + 1])] == pytest.approx(table[i, prompt_ids[i + 1]].item(), abs=2e-3)
            for t, v in zip(top_ids[i].tolist(), values[i].tolist(), strict=True):
                assert scores[str(t)] == pytest.approx(v, abs=2e-3)
    streamed = httpx.post(server.url + "/generate_stream", json=body, timeout=180).text.split("\n\n")
    first = json.loads(streamed[0].removeprefix("data:"))
    assert first["prompt_token_ids"] == prompt_ids and first["prompt_logprobs"] == out["prompt_logprobs"]
    assert all("prompt_logprobs" not in json.loads(e.removeprefix("data:")) for e in streamed[1:] if e.strip())
