"""LightLLM v1.2.0 parity through the real server (tiny random Llama, </s>=2): /generate_stream events field by field
as LightLLM's clients read them, /generate's extra fields, LightLLM's probe / load / name endpoints, and the
per-request metrics (prompt tokens, finish reasons, latencies, max_tokens) moving by exactly what known requests
should move them."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from mmserve.testing.server_proc import ServerProcess, serving

PROMPT = "A chat between a curious human and an artificial intelligence assistant. USER: Describe Beijing."
EOS = 2
TOKEN_KEYS = {"id", "text", "logprob", "special", "count_output_tokens", "prompt_tokens", "logprobs"}
EVENT_KEYS = {"token", "generated_text", "finished", "finish_reason", "details", "input_usage", "prompt_cache_len"}


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    with serving(ServerProcess(e2e_model_dir, log, "--max_total_token_num", "2048")) as srv:
        yield srv


def generate(server, **parameters) -> dict:
    r = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def raw_stream(server, **parameters) -> str:
    body = {"inputs": PROMPT, "parameters": parameters}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read().decode()


def events_of(raw: str) -> list[dict]:
    """LightLLM's framing: `data:{json}` then a blank line, nothing else (no `data: [DONE]`)."""
    chunks = raw.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data:{") for c in chunks[:-1]), raw[:300]
    return [json.loads(c[len("data:") :]) for c in chunks[:-1]]


def labelled(server, name: str) -> dict[str, float]:
    """A metric's samples by their label text, e.g. {'finished_reason="stop"': 3.0}."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {m[1]: float(m[2]) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


def test_stream_events_are_lightllm_shaped(server):
    full = generate(server, max_new_tokens=8, ignore_eos=True, return_details=True)
    events = events_of(raw_stream(server, max_new_tokens=8, ignore_eos=True))
    assert len(events) == 8  # one event per token
    prompt_tokens = full["prompt_tokens"]
    for i, (ev, detail) in enumerate(zip(events, full["tokens"], strict=True)):
        assert set(ev) == EVENT_KEYS and set(ev["token"]) == TOKEN_KEYS, ev
        token = ev["token"]
        assert token["id"] == detail["id"] and token["logprob"] == pytest.approx(detail["logprob"], abs=1e-4)
        assert token["count_output_tokens"] == i + 1 and token["prompt_tokens"] == prompt_tokens
        assert token["special"] is False
        (key, info) = token["logprobs"].popitem()
        assert key == str(token["id"]) and info["logprob"] == token["logprob"] and info["rank"] is None
        assert ev["details"] is None
        assert ev["input_usage"] == {"input_text_tokens": prompt_tokens, "input_audio_tokens": 0,
                                     "input_image_tokens": 0}  # fmt: skip
        last = i == 7
        assert ev["finished"] is last and ev["finish_reason"] == ("length" if last else None)
        assert ev["generated_text"] == (full["generated_text"][0] if last else None)
    assert "".join(ev["token"]["text"] for ev in events) == full["generated_text"][0]


def test_stream_of_an_eos_end(server):
    """Only EOS allowed: one event, the special EOS token, finish_reason stop."""
    (ev,) = events_of(raw_stream(server, max_new_tokens=4, allowed_token_ids=[EOS]))
    assert ev["token"]["id"] == EOS and ev["token"]["special"] is True and ev["token"]["count_output_tokens"] == 1
    assert ev["finished"] is True and ev["finish_reason"] == "stop" and ev["token"]["text"] == ""


def test_generate_has_lightllm_logprobs_and_input_usage(server):
    out = generate(server, max_new_tokens=5, ignore_eos=True, return_details=True)
    assert [list(lp) for lp in out["logprobs"]] == [[str(t["id"])] for t in out["tokens"]]
    assert [lp[str(t["id"])]["logprob"] for lp, t in zip(out["logprobs"], out["tokens"], strict=True)] == [
        t["logprob"] for t in out["tokens"]
    ]
    assert [t["count_output_tokens"] for t in out["tokens"]] == [1, 2, 3, 4, 5]
    assert all(t["prompt_tokens"] == out["prompt_tokens"] and t["special"] is False for t in out["tokens"])
    assert out["input_usage"] == {"input_text_tokens": out["prompt_tokens"], "input_audio_tokens": 0,
                                  "input_image_tokens": 0}  # fmt: skip
    two = generate(server, n=2, max_new_tokens=3, ignore_eos=True)
    assert len(two["logprobs"]) == 2 and all(len(lp) == 3 for lp in two["logprobs"])


def test_probe_and_name_endpoints(server):
    url = server.url
    assert httpx.get(url + "/healthz").json() == {"message": "Ok"}
    for path in ("/health", "/healthz"):
        head = httpx.head(url + path)
        assert head.status_code == 200 and head.content == b""
    assert httpx.get(url + "/health").json() == {"status": "ok", "message": "Ok"}
    for method in ("GET", "POST"):
        assert httpx.request(method, url + "/liveness").json() == {"status": "ok"}
        ready = httpx.request(method, url + "/readiness")
        assert ready.status_code == 200 and ready.json() == {"status": "ok"}
        model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        assert httpx.request(method, url + "/get_model_name").json() == {"model_name": model_id}
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    for path in ("/healthz", "/liveness", "/readiness", "/get_model_name", "/token_load"):
        assert path in paths


def test_token_load_follows_the_running_request(server):
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    idle = httpx.get(server.url + "/token_load").json()
    assert idle == {"current_load": 0.0, "logical_max_load": 0.0, "dynamic_max_load": 0.0}
    total = server.metrics()["mmserve_kv_tokens_total"]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 500, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        load = httpx.get(server.url + "/token_load").json()
    peak = (first["token"]["prompt_tokens"] + 500 - 1) / total  # the slots it holds at its last token
    assert load["dynamic_max_load"] == load["logical_max_load"] == pytest.approx(peak)
    assert 0 < load["current_load"] < peak
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)  # the client left: aborted, freed
    assert httpx.get(server.url + "/token_load").json() == idle


def test_request_metrics_move_by_the_requests(server):
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    before, reasons = server.metrics(), labelled(server, "mmserve_request_success_total")
    length = generate(server, max_new_tokens=5, ignore_eos=True)
    stop = generate(server, max_new_tokens=4, allowed_token_ids=[EOS])
    assert length["finish_reason"] == "length" and stop["finish_reason"] == "stop"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 300, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))  # a first token, then the client leaves

    def reason_moved(reason: str) -> float:
        label = f'finished_reason="{reason}"'
        return labelled(server, "mmserve_request_success_total").get(label, 0.0) - reasons.get(label, 0.0)

    deadline = time.monotonic() + 15
    while reason_moved("abort") == 0:  # the abort's end comes back from the router a moment after the client left
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.05)
    assert (reason_moved("length"), reason_moved("stop"), reason_moved("abort")) == (1, 1, 1)
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # three prefills of the same prompt (the aborted one got its first token)
    assert moved("mmserve_prompt_tokens_total") == 3 * length["prompt_tokens"]
    assert moved("mmserve_request_params_max_tokens_count") == 3
    assert moved("mmserve_request_params_max_tokens_sum") == 5 + 4 + 300
    # latencies of the two requests whose clients stayed; the queue time of all three (each was admitted)
    assert moved("mmserve_e2e_request_latency_seconds_count") == 2
    assert moved("mmserve_request_inference_time_seconds_count") == 2
    assert moved("mmserve_request_queue_time_seconds_count") == 3
    e2e = moved("mmserve_e2e_request_latency_seconds_sum")
    assert 0 < moved("mmserve_request_inference_time_seconds_sum") < e2e
    # the inference time split at the first token: prefill, then decode
    prefill, decode = "mmserve_request_prefill_time_seconds", "mmserve_request_decode_time_seconds"
    assert moved(prefill + "_count") == moved(decode + "_count") == 2
    split = moved(prefill + "_sum") + moved(decode + "_sum")
    assert 0 < split <= moved("mmserve_request_inference_time_seconds_sum") + 1e-6
