"""At --log_level debug, every request that reaches the router leaves the lines benchmarks/ttft_stages.py joins by
rid: the HTTP side's `request timing` (its start, read and parse), the preparer's `image request timing` and the
router's `router timing`. The /generate routes and the OpenAI routes both write them, so a burst sent through
either API can be taken apart stage by stage (the script's parsing has its own tests, tests/unit/benchmarks)."""

from __future__ import annotations

import re

import httpx
import pytest

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_llava_hf(str(tmp_path_factory.mktemp("llava")))
    log = tmp_path_factory.mktemp("log") / "server.log"
    with serving(ServerProcess(model_dir, str(log), "--enable_multimodal", "--log_level", "debug")) as srv:
        yield srv


def _generate(url: str, seed: int) -> None:
    image = {"type": "base64", "data": png_b64(picture(40, 30, seed))}
    body = {"inputs": "USER: <image>\nWhat? ASSISTANT:", "parameters": {"max_new_tokens": 2},
            "multimodal_params": {"images": [image]}}  # fmt: skip
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200


def _chat(url: str, seed: int, stream: bool) -> None:
    image_url = "data:image/png;base64," + png_b64(picture(40, 30, seed))
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": image_url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "stream": stream}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def _fields(lines: list[str], kind: str) -> dict[str, dict[str, str]]:
    """rid -> the `key=value` fields of its `kind timing:` line."""
    out = {}
    for line in lines:
        if f" DEBUG {kind} timing: " in line:  # "DEBUG request" is not "DEBUG image request"
            fields = dict(re.findall(r"(\w+)=(\S+)", line.split(f" DEBUG {kind} timing: ", 1)[1]))
            out[fields["rid"]] = fields
    return out


def test_both_apis_log_every_stage_of_their_requests(server):
    healthy = len(server.log())
    _generate(server.url, 1)
    _chat(server.url, 2, stream=False)
    _chat(server.url, 3, stream=True)
    lines = server.log()[healthy:].splitlines()
    http, image, router = (_fields(lines, kind) for kind in ("request", "image request", "router"))
    assert len(http) == 3, f"`request timing` lines: {sorted(http)}"
    assert set(http) == set(image) == set(router), (sorted(http), sorted(image), sorted(router))
    for rid, f in http.items():
        assert {"bytes", "read_ms", "parse_ms", "prepare_ms", "total_ms", "start"} <= f.keys(), (rid, f)
        assert float(f["start"]) > 0 and float(f["total_ms"]) >= float(f["read_ms"]), (rid, f)
        assert float(router[rid]["first_token_ms"]) > 0, router[rid]
