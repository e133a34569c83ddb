"""A fresh server does its one-time work before /health says ready, not in its first requests: with Python's import
profiler on (PYTHONPROFILEIMPORTTIME, one log line per module imported, in every process of the server), the first
requests of each kind (a text stream, an image, a streamed chat with an image, /metrics) import no module. An import
on the HTTP event loop stalls every request in flight beside it, and more so with cold bytecode caches."""

from __future__ import annotations

import httpx
import pytest

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_llava_hf(str(tmp_path_factory.mktemp("llava")))
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    with serving(ServerProcess(model_dir, str(log), "--enable_multimodal", env=env)) as srv:
        yield srv


def imports_since(srv: ServerProcess, start: int) -> list[str]:
    return [line for line in srv.log()[start:].splitlines() if line.startswith("import time:")]


def test_the_first_requests_import_nothing(server):
    healthy = len(server.log())
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
    text = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 4}}
    with httpx.stream("POST", server.url + "/generate_stream", json=text, timeout=60) as stream:
        assert stream.status_code == 200
        assert [line for line in stream.iter_lines() if line.startswith("data:")]
    image = {"type": "base64", "data": png_b64(picture(40, 30, 1))}
    body = {"inputs": "USER: <image>\nWhat? ASSISTANT:", "parameters": {"max_new_tokens": 4},
            "multimodal_params": {"images": [image]}}  # fmt: skip
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
    url = "data:image/png;base64," + png_b64(picture(40, 30, 2))
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as stream:
        assert stream.status_code == 200
        assert "data: [DONE]" in list(stream.iter_lines())
    assert imports_since(server, healthy) == []
