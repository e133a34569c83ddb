"""The real server (three processes, zmq, uvicorn) on a tiny random Llama, checked over HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from language.sampling_params import SamplingParams
from mmserve.detok.detokenizer import DECODE_KWARGS
from mmserve.llm import LLM
from mmserve.testing.server_proc import ServerProcess

KV_SLOTS = 512
PROMPTS = [
    "What is AI?",
    "Hello",
    "A chat between a curious human and an artificial intelligence assistant. USER: Describe Beijing. ASSISTANT:",
    "北京 重庆 上海 你好 世界 🙂",
    "def hello(name):\n    return",
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, façade",
    "0123456789 + - * / =",
]


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    srv = ServerProcess(
        e2e_model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", str(KV_SLOTS)
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()
        assert srv.children, "the server had no child processes"
        assert srv.leftover_children() == [], "child processes outlived the server"


@pytest.fixture(scope="module")
def llm(e2e_model_dir):
    return LLM(e2e_model_dir, max_total_token_num=8192, device="cpu")


@pytest.fixture(scope="module")
def tokenizer(e2e_model_dir):
    return AutoTokenizer.from_pretrained(e2e_model_dir)


def generate(server, inputs: str, **parameters) -> dict:
    r = httpx.post(server.url + "/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server, inputs: str, **parameters) -> list[dict]:
    events = []
    body = {"inputs": inputs, "parameters": parameters}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.metrics()
    assert m["mmserve_kv_tokens_total"] == KV_SLOTS
    for name in (
        "mmserve_requests_total",
        "mmserve_requests_running",
        "mmserve_requests_waiting",
        "mmserve_kv_tokens_used",
        "mmserve_generated_tokens_total",
        "mmserve_time_to_first_token_seconds_count",
        "mmserve_time_per_output_token_seconds_count",
    ):
        assert name in m


def test_greedy_generate_equals_engine_and_hf(server, llm, e2e_model_dir, tokenizer):
    hf = AutoModelForCausalLM.from_pretrained(e2e_model_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS[:4]:
        out = generate(server, prompt, max_new_tokens=24, return_details=True)
        ids = [t["id"] for t in out["tokens"]]
        prompt_ids = tokenizer(prompt).input_ids
        assert out["prompt_tokens"] == len(prompt_ids)
        assert ids == llm.generate([prompt], SamplingParams(max_new_tokens=24))[0].token_ids
        with torch.no_grad():
            hf_ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids) :]
        assert ids == hf_ids.tolist()
        assert out["generated_text"] == [tokenizer.decode(ids, **DECODE_KWARGS)]
        assert out["count_output_tokens"] == len(ids)
        assert "".join(t["text"] for t in out["tokens"]) == out["generated_text"][0]


def test_32_concurrent_requests_all_correct(server, llm):
    cases = [(PROMPTS[i % len(PROMPTS)], 6 + 3 * (i % 5)) for i in range(32)]
    expected = llm.generate(
        [p for p, _ in cases], [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in cases]
    )

    async def run_all():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            reqs = [
                client.post(
                    server.url + "/generate",
                    json={"inputs": p, "parameters": {"max_new_tokens": n, "ignore_eos": True, "return_details": True}},
                )
                for p, n in cases
            ]
            return await asyncio.gather(*reqs)

    before = server.metrics()["mmserve_requests_total"]
    responses = asyncio.run(run_all())
    for (prompt, n), r, exp in zip(cases, responses, expected, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert [t["id"] for t in body["tokens"]] == exp.token_ids, prompt
        assert body["generated_text"] == [exp.text]
        assert body["finish_reason"] == "length" and body["count_output_tokens"] == n
    assert server.metrics()["mmserve_requests_total"] == before + 32


def test_stream_concatenates_to_generate(server):
    for prompt in PROMPTS[2:6]:
        full = generate(server, prompt, max_new_tokens=20, ignore_eos=True)
        events = stream_events(server, prompt, max_new_tokens=20, ignore_eos=True)
        assert all(not e["finished"] for e in events[:-1]) and events[-1]["finished"]
        assert events[-1]["finish_reason"] == "length" and events[-1]["token"]["count_output_tokens"] == 20
        text = "".join(e["token"]["text"] for e in events)
        assert text == full["generated_text"][0] == events[-1]["generated_text"]
        assert len(events) == 20  # one event per token, as LightLLM's


def test_stop_sequences_cut_the_text(server):
    prompt = PROMPTS[0]
    free = generate(server, prompt, max_new_tokens=30, ignore_eos=True)["generated_text"][0]
    stop = free[8:11]
    assert stop.strip(), free
    cut = free[: free.index(stop)]
    for stops in (stop, [stop], ["never-in-the-text", stop]):
        out = generate(server, prompt, max_new_tokens=30, ignore_eos=True, stop_sequences=stops)
        assert out["generated_text"] == [cut] and out["finish_reason"] == "stop"
        assert out["count_output_tokens"] < 30
    events = stream_events(server, prompt, max_new_tokens=30, ignore_eos=True, stop_sequences=stop)
    assert "".join(e["token"]["text"] for e in events) == cut
    assert events[-1]["finish_reason"] == "stop"
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)  # the stopped request's slots were freed


def test_max_new_tokens_gives_length(server):
    out = generate(server, PROMPTS[1], max_new_tokens=7, ignore_eos=True)
    assert out["finish_reason"] == "length" and out["count_output_tokens"] == 7
    assert "tokens" not in out


LONG = {"max_new_tokens": KV_SLOTS - 40, "ignore_eos": True}


def test_stream_disconnect_frees_slots(server):
    before = server.metrics()["mmserve_generated_tokens_total"]
    body = {"inputs": PROMPTS[0], "parameters": LONG}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept open: closing the iterator closes the connection
        while not next(lines).startswith("data:"):
            pass
        assert server.metrics()["mmserve_kv_tokens_used"] > 0
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    assert server.metrics()["mmserve_requests_running"] == 0
    assert server.metrics()["mmserve_generated_tokens_total"] - before < LONG["max_new_tokens"]


def test_generate_disconnect_frees_slots(server):
    before = server.metrics()["mmserve_generated_tokens_total"]

    async def start_then_leave():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(
                client.post(server.url + "/generate", json={"inputs": PROMPTS[2], "parameters": LONG})
            )
            await asyncio.to_thread(server.wait_metric, "mmserve_kv_tokens_used", lambda v: v > 0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(start_then_leave())
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    assert server.metrics()["mmserve_generated_tokens_total"] - before < LONG["max_new_tokens"]


BAD_REQUESTS = [
    (b"this is not json", "body"),
    (b"[1, 2, 3]", "body"),
    ({}, "inputs"),
    ({"inputs": ""}, "inputs"),
    ({"inputs": 42}, "inputs"),
    ({"inputs": "x", "parameters": "fast"}, "parameters"),
    ({"inputs": "x", "parameters": {"max_tokens": 5}}, "parameters.max_tokens"),
    ({"inputs": "x", "parameters": {"temperature": -0.5}}, "parameters.temperature"),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"inputs": "x", "parameters": {"top_k": -2}}, "parameters.top_k"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 10**9}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 3.5}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"do_sample": "yes"}}, "parameters.do_sample"),
    ({"inputs": "x", "parameters": {"stop_sequences": [1, 2]}}, "parameters.stop_sequences"),
    ({"inputs": "x", "parameters": {"seed": -5}}, "parameters.seed"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
    ({"inputs": "word " * 2000}, "inputs"),
    (
        {"inputs": "x", "multimodal_params": {"images": [{"type": "url", "data": "http://x/a.png"}]}},
        "multimodal_params.images",
    ),
    (
        {"inputs": "x", "multimodal_params": {"videos": [{"type": "base64", "data": "AAAA"}]}},
        "multimodal_params.videos",
    ),
]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, path):
    for body, field in BAD_REQUESTS:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + path, timeout=30, **kw)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["field"] == field, (body, r.json())
        assert field in r.json()["error"]
    r = httpx.get(server.url + path)
    assert r.status_code == 405 and r.json()
    assert generate(server, PROMPTS[1], max_new_tokens=3)["count_output_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_oversized_body_gets_413(server):
    r = httpx.post(server.url + "/generate", content=b"x" * (65 << 20), timeout=60)
    assert r.status_code == 413 and r.json()["field"] == "body"
    assert generate(server, PROMPTS[1], max_new_tokens=2)["count_output_tokens"] >= 1


def test_router_never_over_admits(server, llm, tokenizer):
    # 16 requests of ~40 + 100 tokens need 2240 slots; the cache has 512, so most must wait their turn
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    assert 30 <= len(tokenizer(prompt).input_ids) <= 60
    prompts = [f"{i} {prompt}" for i in range(16)]
    peak = {"kv": 0.0, "waiting": 0.0}

    async def run_all():
        async def watch():
            while True:
                m = await asyncio.to_thread(server.metrics)
                peak["kv"] = max(peak["kv"], m["mmserve_kv_tokens_used"])
                peak["waiting"] = max(peak["waiting"], m["mmserve_requests_waiting"])
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
            reqs = [
                client.post(
                    server.url + "/generate",
                    json={"inputs": p, "parameters": {"max_new_tokens": 100, "ignore_eos": True}},
                )
                for p in prompts
            ]
            responses = await asyncio.gather(*reqs)
        watcher.cancel()
        return responses

    responses = asyncio.run(run_all())
    expected = llm.generate(prompts, SamplingParams(max_new_tokens=100, ignore_eos=True))
    for r, exp in zip(responses, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["finish_reason"] == "length" and r.json()["count_output_tokens"] == 100
        assert r.json()["generated_text"] == [exp.text]
    assert 0 < peak["kv"] <= KV_SLOTS
    assert peak["waiting"] > 0
    assert server.metrics()["mmserve_kv_tokens_used"] == 0


@pytest.mark.parametrize("top_k", [{"top_k": 50}, {}], ids=["top-k", "nucleus"])  # each way a row draws
def test_seeded_sampling_is_reproducible(server, top_k):
    params = {
        "do_sample": True,
        "temperature": 1.5,
        "top_p": 0.95,
        "seed": 7,
        "max_new_tokens": 16,
        "ignore_eos": True,
        "return_details": True,
        **top_k,
    }
    first, again = generate(server, PROMPTS[0], **params), generate(server, PROMPTS[0], **params)
    greedy = generate(server, PROMPTS[0], max_new_tokens=16, ignore_eos=True, return_details=True)
    assert [t["id"] for t in first["tokens"]] == [t["id"] for t in again["tokens"]]
    assert [t["id"] for t in first["tokens"]] != [t["id"] for t in greedy["tokens"]]
