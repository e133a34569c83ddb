"""At --log_level debug, every request that reaches the router leaves the lines benchmarks/ttft_stages.py joins by
rid: the HTTP side's `request timing` (its start, read and parse), the preparer's `image request timing` and the
router's `router timing`. The /generate routes and the OpenAI routes both write them, so a burst sent through
either API can be taken apart stage by stage."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.ttft_stages import burst_stages, bursts, requests_and_steps
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


def test_both_apis_log_every_stage_of_their_requests(server):
    healthy = len(server.log())
    _generate(server.url, 1)
    _chat(server.url, 2, stream=False)
    _chat(server.url, 3, stream=True)
    reqs, steps = requests_and_steps(server.log()[healthy:].splitlines())
    assert len(reqs) == 3, f"requests with an HTTP start and a first token: {sorted(reqs)}"
    for rid, r in reqs.items():
        assert {"read+parse", "image+prompt", "encode wait", "router"} <= r.keys(), (rid, sorted(r))
    assert steps, "no `step timing` line"
    (burst,) = bursts(reqs, gap_s=60.0)
    stages = burst_stages(burst)
    assert len(stages["first token"]) == 3 and all(t > 0 for t in stages["first token"])
