"""Sampling parameters the engine's dtypes cannot hold, through the real server (tiny random Llama): each gets a 400
naming it on /generate and the OpenAI routes, and the server goes on serving; ordinary values that used to overflow
(an EOS length boost over 1800 tokens) just work; log-probabilities always reach the client as strict JSON."""

from __future__ import annotations

import json

import httpx
import pytest

from mmserve.testing.server_proc import ServerProcess, serving

PROMPT = "A chat between a curious human and an artificial intelligence assistant. USER: Describe Beijing."


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    srv = ServerProcess(
        e2e_model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", "2048"
    )
    with serving(srv):  # stopped cleanly: exit 0, no child or segment left
        yield srv


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which Python's json writes but JSON does not have."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in a JSON response")

    return json.loads(text, parse_constant=refuse)


def generate(server, path: str = "/generate", **parameters) -> httpx.Response:
    return httpx.post(server.url + path, json={"inputs": PROMPT, "parameters": parameters}, timeout=300)


def chat(server, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def completion(server, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 4, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def still_serving(server) -> None:
    r = generate(server, max_new_tokens=3, ignore_eos=True)
    assert r.status_code == 200 and strict_json(r.text)["count_output_tokens"] == 3, r.text
    assert server.proc.poll() is None
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)


def refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    error = strict_json(r.text)["error"]  # /generate: a string; OpenAI's routes: {"message", "param", ...}
    assert field in (error if isinstance(error, str) else error["param"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**64),
        ("top_k", 2**63),
        ("repetition_penalty", 5e-324),
        ("top_p", 5e-324),
        ("min_p", 1e308),
        ("exponential_decay_length_penalty", [0, 1e308]),
        ("stop_token_ids", [2**64]),
        ("allowed_token_ids", [2**40]),
    ],
)
def test_generate_refuses_what_the_engine_cannot_hold(server, field, value):
    for path in ("/generate", "/generate_stream"):
        refused(generate(server, path, do_sample=True, max_new_tokens=2, return_details=True, **{field: value}), field)
    still_serving(server)


@pytest.mark.parametrize(
    "field, value", [("top_k", 2**64), ("repetition_penalty", 5e-324), ("top_p", 5e-324), ("min_p", -1)]
)
def test_openai_routes_refuse_what_the_engine_cannot_hold(server, field, value):
    refused(chat(server, logprobs=True, top_logprobs=2, **{field: value}), field)
    refused(completion(server, logprobs=2, **{field: value}), field)
    still_serving(server)


def test_a_long_eos_boost_runs_to_the_end(server):
    """1.5 ** 1800 is beyond any float: the boost is capped, the request runs all its tokens."""
    r = generate(server, max_new_tokens=1800, ignore_eos=True, exponential_decay_length_penalty=[0, 1.5])
    assert r.status_code == 200, r.text
    assert strict_json(r.text)["count_output_tokens"] == 1800
    still_serving(server)


def test_logprobs_are_strict_json_at_the_bounds(server):
    """The smallest repetition penalty and the largest EOS boost the server takes: every log-probability on every
    route is a finite JSON number."""
    extreme = {"repetition_penalty": 0.01, "max_new_tokens": 6, "ignore_eos": True, "return_details": True}
    boost = {"exponential_decay_length_penalty": [0, 10.0], "min_new_tokens": 0}
    for parameters in (extreme, {**extreme, **boost}):
        body = strict_json(generate(server, **parameters).text)
        assert len(body["tokens"]) == 6
        stream = generate(server, "/generate_stream", **parameters)
        assert stream.status_code == 200
        events = [strict_json(line[5:]) for line in stream.text.splitlines() if line.startswith("data:")]
        assert events[-1]["finished"] and all(e["token"]["logprob"] is not None for e in events)
    r = completion(server, logprobs=5, repetition_penalty=0.01, max_tokens=6)
    assert r.status_code == 200, r.text
    assert len(strict_json(r.text)["choices"][0]["logprobs"]["token_logprobs"]) == 6
    still_serving(server)
