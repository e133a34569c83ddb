"""The OpenAI routes take the sampling a checkpoint's generation_config.json recommends for the fields a request
leaves unset (vLLM's --generation-config auto): here top-k 1 (so an unset temperature still answers greedily), and
max_new_tokens 5 (the default max_tokens) from vLLM's --override-generation-config; the fields a request sets win,
and /generate keeps LightLLM's defaults."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from transformers import GenerationConfig

from mmserve.testing.server_proc import ServerProcess, serving

DEFAULT_MAX = 5
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("recommends") / "model"
    shutil.copytree(e2e_model_dir, folder)
    recommended = dict(do_sample=True, temperature=0.9, top_k=1)
    GenerationConfig(bos_token_id=1, eos_token_id=2, **recommended).save_pretrained(folder)
    override = json.dumps({"max_new_tokens": DEFAULT_MAX})  # vLLM's flag: over the file's fields
    template = folder / "chat.jinja"  # this tiny Llama has no chat template of its own
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = ServerProcess(str(folder), log, "--max_total_token_num", "2048", "--chat_template", str(template),
                        "--override-generation-config", override)  # fmt: skip
    with serving(srv):
        yield srv


def _chat(server, **fields) -> dict:
    body = {"model": "model", "messages": MESSAGES, "ignore_eos": True, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_unset_fields_take_the_checkpoints_values(server) -> None:
    unset = _chat(server)
    assert unset["usage"]["completion_tokens"] == DEFAULT_MAX
    greedy = _chat(server, temperature=0, max_tokens=DEFAULT_MAX)
    assert unset["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]  # top-k 1
    body = {"model": "model", "prompt": "Hello", "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == DEFAULT_MAX, r.text


def test_the_requests_own_fields_win(server) -> None:
    assert _chat(server, max_tokens=8)["usage"]["completion_tokens"] == 8
    answers = {_chat(server, top_k=-1, temperature=1.5, seed=s)["choices"][0]["message"]["content"] for s in range(6)}
    assert len(answers) > 1  # sampled: top-k 1 no longer holds


def test_generate_keeps_lightllms_defaults(server) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 9, "ignore_eos": True, "return_details": True}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["tokens"]) == 9, r.text
