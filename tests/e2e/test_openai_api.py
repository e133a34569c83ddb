"""Issue 9's OpenAI API over real HTTP with the real `openai` client, on the tiny Qwen2-VL demo checkpoint that
carries Qwen2-VL's published chat template: chat replies equal HF transformers' greedy output on the same weights
and the same template (apply_chat_template), text and usage alike; streamed pieces join to the non-streamed text;
a multi-turn two-image conversation; errors in OpenAI's shape with the right status while the server keeps serving;
/v1/models; /v1/completions; the example client."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from mmserve.http.openai_protocol import render_chat
from mmserve.http.protocol import BadRequest
from mmserve.testing.checkpoints.qwen2_vl_demo import build_qwen2_vl_demo
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.models.hf_reference import hf_greedy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW_TOKENS = 12
MODEL = "qwen2vl"  # the model folder's name


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + png_b64(image)


def openai_messages(turns: list) -> list[dict]:
    """[(role, [str | Image, ...]), ...] -> OpenAI messages with text and image_url parts."""
    return [
        {
            "role": role,
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(p)}}
                if isinstance(p, Image.Image)
                else {"type": "text", "text": p}
                for p in parts
            ],
        }
        for role, parts in turns
    ]


def hf_messages(turns: list) -> tuple[list[dict], list[Image.Image]]:
    messages = [
        {
            "role": role,
            "content": [
                {"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts
            ],
        }
        for role, parts in turns
    ]
    return messages, [p for _, parts in turns for p in parts if isinstance(p, Image.Image)]


ONE_IMAGE = [("user", [picture(150, 100, 1), "Describe this picture."])]
MULTI_TURN = [
    ("user", [picture(60, 200, 2), "What is in this picture?"]),
    ("assistant", ["A tall city at night."]),
    ("user", ["And in this one?", picture(333, 77, 3), "Compare the two."]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("openai") / MODEL)
    os.makedirs(path)
    return build_qwen2_vl_demo(path)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("images")
    picture(64, 48, 7).save(path / "local.png")
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, image_dir, tmp_path_factory):
    srv = ServerProcess(
        model_dir,
        str(tmp_path_factory.mktemp("log") / "server.log"),
        "--max_total_token_num",
        "4096",
        "--enable_multimodal",
        "--image_dir",
        image_dir,
        "--chunked_prefill_size",
        "32",
    )
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(model_dir):
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=Qwen2VLVideoProcessor(),
    )


@pytest.fixture(scope="module")
def hf(hf_model, processor):
    model = hf_model

    def greedy(turns: list) -> tuple[list[int], str, int]:
        """HF's greedy ids, their text and the prompt's token count, on the checkpoint's own template."""
        messages, images = hf_messages(turns)
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        prompt_ids = inputs["input_ids"][0].tolist()
        ids = hf_greedy(model, prompt_ids, NEW_TOKENS, **extra)
        return ids, processor.tokenizer.decode(ids, skip_special_tokens=True), len(prompt_ids), text

    return greedy


def chat(client, turns, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=openai_messages(turns),
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_models_lists_the_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model"


@pytest.mark.parametrize("turns", [ONE_IMAGE, MULTI_TURN], ids=["one_image", "multi_turn_two_images"])
def test_chat_equals_hf_greedy_and_the_stream_joins_to_it(client, server, hf, turns):
    ids, text, prompt_len, rendered = hf(turns)
    reply = chat(client, turns)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, NEW_TOKENS)
    assert reply.usage.total_tokens == prompt_len + NEW_TOKENS

    # The token ids: /generate on the HF-rendered prompt and the same images gives HF's ids and the same text.
    images = hf_messages(turns)[1]
    body = {
        "inputs": rendered,
        "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": [{"type": "base64", "data": data_url(im).split(",", 1)[1]} for im in images]},
    }
    generated = httpx.post(server.url + "/generate", json=body, timeout=180).json()
    assert [t["id"] for t in generated["tokens"]] == ids
    assert generated["generated_text"] == [text]

    chunks = list(chat(client, turns, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW_TOKENS
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_ends_with_done_and_string_content_works(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_sampling_fields_and_stop(client):
    turns = [("user", ["Tell me a story."])]
    greedy = chat(client, turns).choices[0].message.content
    stop = greedy[3:6]
    if stop.strip():
        cut = chat(client, turns, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == greedy[: greedy.index(stop)]
    seeded = [
        client.chat.completions.create(
            model=MODEL,
            messages=openai_messages(turns),
            max_completion_tokens=8,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body={"top_k": 20, "ignore_eos": True},
        )
        for _ in range(2)
    ]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
    assert seeded[0].usage.completion_tokens == 8


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return info.value


def test_errors_in_openai_shape_and_the_server_keeps_serving(client, server):
    bad = base64.b64encode(b"not a picture").decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{bad}"}},
                {"type": "text", "text": "What?"},
            ],
        }
    ]
    e = error_of(lambda: client.chat.completions.create(model=MODEL, messages=messages))
    assert e.status_code == 400 and "image[0]" in e.response.json()["error"]["message"]
    assert e.response.json()["error"]["type"] == "invalid_request_error"

    path = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]
    e = error_of(lambda: client.chat.completions.create(model=MODEL, messages=path))
    assert e.status_code == 400 and "allowed image directory" in e.response.json()["error"]["message"]

    text = [{"role": "user", "content": "Hi"}]
    for kwargs, param in [
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ]:
        e = error_of(lambda kwargs=kwargs: client.chat.completions.create(model=MODEL, messages=text, **kwargs))
        assert e.status_code == 400 and e.response.json()["error"]["param"] == param, e.response.json()
    e = error_of(lambda: client.chat.completions.create(model="gpt-4o", messages=text))
    assert e.status_code == 404 and e.response.json()["error"]["param"] == "model"

    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert chat(client, ONE_IMAGE).usage.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize(
    "route,fields,param",
    [
        ("chat", {"max_tokens": 10**6}, "max_tokens"),
        ("chat", {"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ("chat", {"max_tokens": 8, "max_completion_tokens": 10**6}, "max_completion_tokens"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("completions", {"max_tokens": 10**6}, "max_tokens"),
        ("completions", {"prompt": "x " * 5000, "max_tokens": 1}, "prompt"),
        ("chat", {"stop": 7}, "stop"),
        ("chat", {"seed": -1}, "seed"),
        ("chat", {"n": 17}, "n"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"frequency_penalty": 3}, "frequency_penalty"),
        ("completions", {"echo": True, "logprobs": 6}, "logprobs"),
    ],
)
def test_errors_name_the_openai_field_the_client_sent(server, route, fields, param):
    """The shared pipeline checks /generate's parameters (max_new_tokens, stop_sequences, inputs); an OpenAI client
    hears about the field it sent, in `param` and in the message."""
    body = {"model": MODEL, **fields}
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Hi")
    r = httpx.post(f"{server.url}/v1/{route.replace('chat', 'chat/completions')}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": "), error
    pipeline_names = ("max_new_tokens", "stop_sequences", "inputs", "parameters.", "prompt_logprobs")
    assert not any(name in error["message"] for name in pipeline_names), error


def test_generate_prompt_logprobs_with_an_image_equal_hf_forward_logits(server, hf_model, processor):
    """prompt_logprobs on Qwen2-VL (M-RoPE positions) with an image, the prompt split over prefill chunks of 32
    tokens: each prompt token's log-probability, the image's placeholder positions included, equals HF's."""
    image = picture(150, 100, 5)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    prompt_ids = inputs["input_ids"][0].tolist()
    assert len(prompt_ids) > 32  # two chunks or more
    with torch.no_grad():
        logits = hf_model(**inputs).logits[0, :-1]
    table = torch.log_softmax(logits.float(), -1)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 2, "prompt_logprobs": True},
            "multimodal_params": {"images": [{"type": "base64", "data": png_b64(image)}]}}  # fmt: skip
    out = httpx.post(server.url + "/generate", json=body, timeout=180).json()
    assert out["prompt_token_ids"] == prompt_ids
    pairs = out["prompt_logprobs"]
    assert [token for token, _ in pairs] == prompt_ids[:-1] and all(len(scores) == 1 for _, scores in pairs)
    ours = [scores[str(prompt_ids[i + 1])] for i, (_, scores) in enumerate(pairs)]
    assert ours == pytest.approx(table.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist(), abs=2e-3)


def test_completions_stream_and_not(client):
    reply = client.completions.create(
        model=MODEL, prompt="What is AI?", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 6
    pieces = list(
        client.completions.create(
            model=MODEL, prompt="What is AI?", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == reply.choices[0].text
    assert (
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"ignore_eos": True}).usage.completion_tokens
        == 16
    )


def test_a_checkpoint_without_a_template_gets_a_clear_400():
    with pytest.raises(BadRequest) as info:
        render_chat(None, None, [{"role": "user", "content": "Hi"}], {})
    assert "no chat template" in info.value.message


def test_example_client_runs(server):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "openai_chat_image.py"),
            "--base_url",
            server.url + "/v1",
            "--max_tokens",
            "4",
            "--stream",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert '"completion_tokens":4' in out.stdout


def test_multiturn_two_image_example_runs(server):
    """examples/openai_multiturn_images.py: three streamed turns about two drawn pictures, the history growing."""
    script = os.path.join(ROOT, "examples", "openai_multiturn_images.py")
    out = subprocess.run([sys.executable, script, "--base_url", server.url + "/v1", "--max_tokens", "4"],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr
    usage = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("[usage ")]
    assert len(usage) == 3 and all(0 < u["completion_tokens"] <= 4 for u in usage), out.stdout
    # each turn resends the pictures, the earlier questions and replies
    for before, after in zip(usage[:-1], usage[1:], strict=True):
        assert after["prompt_tokens"] > before["prompt_tokens"] + before["completion_tokens"]
    assert usage[0]["prompt_tokens"] > 2 * 4  # the two pictures' vision tokens are in every prompt


def test_no_max_tokens_fills_the_context(client, server):
    """As vLLM's: with no max_tokens the reply may use all that the prompt leaves (4096 KV slots here). The prompt
    is padded to leave a few dozen tokens, so the reply is short enough to decode quickly on a CPU."""

    def chat(turns, filler_words: int, **kwargs):
        role, parts = turns[-1]
        padded = [*turns[:-1], (role, [*parts, " a" * filler_words])]
        return client.chat.completions.create(
            model=MODEL, messages=openai_messages(padded), temperature=0, extra_body={"ignore_eos": True}, **kwargs
        )

    for turns in ([("user", ["Hi"])], ONE_IMAGE):
        base = chat(turns, 0, max_tokens=1).usage.prompt_tokens
        per_word = (chat(turns, 1000, max_tokens=1).usage.prompt_tokens - base) / 1000
        words = int((4096 - 40 - base) / per_word)
        reply = chat(turns, words)
        prompt = reply.usage.prompt_tokens
        assert 4096 - 100 < prompt < 4096, f"the padding missed its mark: {prompt}-token prompt"
        assert reply.usage.total_tokens == 4096 and reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 4096 - prompt


def test_a_local_path_inside_image_dir_reads_that_file(client):
    """--image_dir reaches the OpenAI routes: a path inside it is the same image as its bytes sent inline."""

    def reply(url: str) -> str:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
        )
        return out.choices[0].message.content

    assert reply("local.png") == reply(data_url(picture(64, 48, 7)))


# A template of our own: text parts only, so what it renders is easy to check (no newlines: transformers renders
# templates with trim_blocks, which drops a newline after a block tag).
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "; {% endfor %}[assistant] "
)


def test_served_model_name_and_chat_template_flags(model_dir, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    srv = ServerProcess(
        model_dir, str(tmp_path / "server.log"), "--served_model_name", "demo-vl", "--chat_template", str(template)
    )
    try:
        srv.wait_healthy()
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        assert [m.id for m in oc.models.list().data] == ["demo-vl"]
        e = error_of(lambda: oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}]))
        assert e.status_code == 404  # the folder's name is no longer the model's id
        reply = oc.chat.completions.create(
            model="demo-vl", messages=[{"role": "user", "content": "Hello there"}], max_tokens=3, temperature=0
        )
        rendered = "[user] Hello there; [assistant] "
        assert reply.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(model_dir)(rendered).input_ids)
    finally:
        assert srv.stop() == 0, srv.log()
