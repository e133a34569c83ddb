"""The HTTP layer under hostile bodies, through the real server (tiny random Llama): deep nesting, lone surrogates,
huge prompts and clients that leave get a 4xx JSON error (or a quiet log line), never a 500 or a stall; and
/openapi.json documents every route's body and error statuses."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from mmserve.testing.server_proc import ServerProcess, serving

POST_ROUTES = ["/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"]
CONTEXT = 1024  # --max_req_total_len: a 10 MB prompt is ~10,000 times too long


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    srv = ServerProcess(
        e2e_model_dir,
        str(tmp_path_factory.mktemp("log") / "server.log"),
        "--max_total_token_num",
        "2048",
        "--max_req_total_len",
        str(CONTEXT),
    )
    with serving(srv):
        yield srv


def post(server, path: str, body: bytes | dict, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps keeps "\ud800" escaped
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def assert_json_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    body = json.loads(r.content.decode("utf-8"))  # strict UTF-8: no lone surrogate made it into the bytes
    assert "error" in body
    return body


def a_normal_request_works(server) -> None:
    r = post(server, "/generate", {"inputs": "Hello there", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").status_code == 200


def valid_body(path: str) -> dict:
    if path.startswith("/generate"):
        return {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    return {"prompt": "Hello", "max_tokens": 2}


@pytest.mark.parametrize("path", POST_ROUTES)
def test_deeply_nested_json_gets_400(server, path):
    deep_array = b"[" * 100_000 + b"]" * 100_000
    assert_json_error(post(server, path, deep_array))
    inner = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    body = json.dumps(valid_body(path)).encode()[:-1] + b', "extra": ' + inner + b"}"
    assert_json_error(post(server, path, body))
    a_normal_request_works(server)


def test_deep_logit_bias_gets_400(server):
    bias = b'{"1":' * 3000 + b"1" + b"}" * 3000
    body = b'{"inputs": "hi", "parameters": {"max_new_tokens": 2, "logit_bias": ' + bias + b"}}"
    error = assert_json_error(post(server, "/generate", body))
    assert "nest" in error["error"]
    a_normal_request_works(server)


SURROGATE_BODIES = [
    ("/generate", {"inputs": "Hello \ud800 there", "parameters": {"max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "Hello \ud800 there", "parameters": {"max_new_tokens": 2}}),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "stop_sequences": ["\udfff"]}}),
    ("/generate", {"inputs": "Hello", "\ud800": 1}),
    ("/generate", {"inputs": "Hello", "parameters": {"\ud800": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \ud800"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "model": "\ud800"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "\udc00": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": "\udfff"}),
]


@pytest.mark.parametrize("path, body", SURROGATE_BODIES)
def test_lone_surrogates_get_a_utf8_400(server, path, body):
    error = assert_json_error(post(server, path, body))
    message = json.dumps(error)
    assert "surrogate" in message, message


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_a_role_that_is_not_a_string_gets_400(server, role):  # found by test_http_fuzz.py
    body = {"messages": [{"role": role, "content": "Hi"}], "max_tokens": 2}
    assert "role" in assert_json_error(post(server, "/v1/chat/completions", body))["error"]["message"]


def test_a_surrogate_pair_is_a_character(server):
    r = post(server, "/generate", {"inputs": "Hello \ud83d\ude00 there", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_huge_prompts_are_refused_without_stalling_others(server):
    huge = {"inputs": "hello world " * 900_000, "parameters": {"max_new_tokens": 2}}  # ~10.8 MB
    body = json.dumps(huge).encode()

    async def run() -> tuple[list[httpx.Response], float, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            start = time.monotonic()
            headers = {"content-type": "application/json"}
            big = [asyncio.create_task(client.post(server.url + "/generate", content=body, headers=headers))
                   for _ in range(2)]  # fmt: skip
            await asyncio.sleep(0.3)  # both bodies are in: their length checks run now
            small_start = time.monotonic()
            small = await client.post(server.url + "/generate", json=valid_body("/generate"))
            small_s = time.monotonic() - small_start
            assert small.status_code == 200, small.text
            answers = await asyncio.gather(*big)
            return answers, small_s, time.monotonic() - start

    answers, small_s, total_s = asyncio.run(run())
    for r in answers:
        error = assert_json_error(r)
        assert error["field"] == "inputs" and "tokens" in error["error"], error
    # Tokenizing one such prompt in full takes 10-15 s; its first ~CONTEXT tokens take milliseconds.
    assert total_s < 6.0 and small_s < 4.0, (total_s, small_s)
    a_normal_request_works(server)


def test_a_prompt_just_over_the_context_is_refused_with_its_length(server):
    r = post(server, "/generate", {"inputs": "word " * (3 * CONTEXT), "parameters": {"max_new_tokens": 2}})
    error = assert_json_error(r)
    assert error["field"] == "inputs" and f"allows {CONTEXT - 1} at most" in error["error"], error


def test_client_leaving_a_generate_logs_no_traceback(server):
    async def start_then_leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"inputs": "Hello", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
            task = asyncio.create_task(client.post(server.url + "/generate", json=body))
            await asyncio.to_thread(server.wait_metric, "mmserve_requests_running", lambda v: v > 0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    for _ in range(3):
        asyncio.run(start_then_leave())
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    time.sleep(0.5)  # the handlers' answers to the closed connections
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    a_normal_request_works(server)


def test_openapi_documents_every_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path in POST_ROUTES:
        op = paths[path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema.get("properties") or schema.get("$ref"), (path, schema)
        for status in ("200", "400", "408", "413", "503"):
            assert status in op["responses"], (path, status)
        assert "application/json" in op["responses"]["400"]["content"], path
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert {"200", "503"} <= set(paths["/health"]["get"]["responses"])
    assert set(paths["/generate_stream"]["post"]["responses"]["200"]["content"]) == {"text/event-stream"}
