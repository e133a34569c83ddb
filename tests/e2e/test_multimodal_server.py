"""--enable_multimodal wiring: the visual process, the shared-memory cache and the router's embedding reads, on a
tiny random LLaVA (llava-hf layout). Equality with HF is tested with the families (tests/models); this checks the
server around them."""

from __future__ import annotations

import base64
import io
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.server_proc import E2E_DEVICE, ServerProcess, serving

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
LONG_STEP_SEQUENCES = 6  # n of one request with a ~3900-token prompt: a prefill step of seconds on a CPU


def image_b64(seed: int, size=(80, 50)) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_llava_hf(str(tmp_path_factory.mktemp("llava")))
    srv = ServerProcess(
        model_dir,
        str(tmp_path_factory.mktemp("log") / "server.log"),
        "--max_total_token_num",
        str(LONG_STEP_SEQUENCES * 4096),
        "--chunked_prefill_size",  # the long prompts below prefill in one step
        str(LONG_STEP_SEQUENCES * 4096),
        "--enable_multimodal",
        "--cache_capacity",
        "2",
    )
    with serving(srv):
        yield srv


def ask(server, *images: str, prompt: str = PROMPT, **parameters) -> httpx.Response:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": 8, "return_details": True, **parameters},
        "multimodal_params": {"images": [{"type": "base64", "data": im} for im in images]},
    }
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def test_same_image_is_encoded_once_with_equal_answers(server):
    first, again = ask(server, image_b64(0)), ask(server, image_b64(0))
    assert first.status_code == again.status_code == 200, first.text
    a, b = first.json(), again.json()
    # The repeat reuses the whole prompt but its last token from the prefix cache; the answer is the same.
    assert a.pop("prompt_cache_len") == 0 and b.pop("prompt_cache_len") == a["prompt_tokens"] - 1
    a_lps, b_lps = [t.pop("logprob") for t in a["tokens"]], [t.pop("logprob") for t in b["tokens"]]
    # LightLLM's `logprobs` repeat each token's: equal ids and texts, log-probabilities within the same bound
    a_all, b_all = a.pop("logprobs"), b.pop("logprobs")
    a_all_lps = [v.pop("logprob") for d in a_all for v in d.values()]
    b_all_lps = [v.pop("logprob") for d in b_all for v in d.values()]
    assert a == b and a_all == b_all
    assert a_lps + a_all_lps == pytest.approx(b_lps + b_all_lps, abs=1e-4)
    m = server.metrics()
    assert m["mmserve_images_encoded_total"] == 1 and m["mmserve_embed_cache_hits_total"] >= 1
    other = ask(server, image_b64(1))
    assert other.status_code == 200 and other.json()["tokens"] != first.json()["tokens"]


def test_more_distinct_images_than_the_cache_holds(server):
    for seed in range(10, 15):  # cache capacity 2: entries are evicted and re-used
        assert ask(server, image_b64(seed)).status_code == 200
    assert server.metrics()["mmserve_embed_cache_items"] <= 2
    assert server.metrics()["mmserve_kv_tokens_used"] == 0


def test_bad_images_get_400_and_text_still_works(server):
    r = ask(server, "!!not base64!!")
    assert r.status_code == 400 and r.json()["field"].startswith("multimodal_params.images")
    r = ask(server)  # a placeholder without its image
    assert r.status_code == 400 and r.json()["field"].startswith("multimodal_params.images")
    text = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert text.status_code == 200 and text.json()["count_output_tokens"] >= 1


def test_image_cache_entries_are_released_once_the_prefill_ran(server):
    """Issue 10: an entry is held while the prefill reads it, not until the request finishes."""
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 1500, "ignore_eos": True},  # decodes for seconds
        "multimodal_params": {"images": [{"type": "base64", "data": image_b64(30)}]},
    }
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(lines).startswith("data:")  # the prefill has run
        server.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v == 0)
        m = server.metrics()
        assert m["mmserve_requests_running"] == 1 and m["mmserve_embed_cache_items_in_use"] == 0  # still decoding
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)  # the dropped stream was aborted


def send_and_hang_up(server, body: dict) -> None:
    """A /generate request whose client closes the connection as soon as the request is sent."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip


@pytest.mark.skipif(E2E_DEVICE != "cpu", reason="acts inside a prefill step: seconds on the CPU, milliseconds on a GPU")
def test_an_abandoned_request_keeps_its_images_until_the_router_dropped_it(server):
    """Issue 34 A3: a request whose client left keeps its cache entries until the router is done with it. Here it
    reaches the router during a long prefill step (the router reads its inbox between steps) with its client
    already gone, and a request with new images needs the room: the router must still find the first request's
    embeddings when it takes it (it crashed with FileNotFoundError when the entry was released at the abort and
    evicted at once), and the newcomer gets its room once the router has dropped the abandoned request."""
    cached = image_b64(40)
    assert ask(server, cached).status_code == 200  # in the cache now: a request for it is sent to the router at once
    long_prompt = " ".join(["go"] * 1300)  # ~3900 tokens
    # Two new tokens: none finishes with its prefill step, so "running" reaches n with the step that prefills the last.
    params = {"max_new_tokens": 2, "n": LONG_STEP_SEQUENCES, "disable_prompt_cache": True}
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(httpx.post, server.url + "/generate", json={"inputs": long_prompt, "parameters": params},
                           timeout=300)  # fmt: skip
        server.wait_metric("mmserve_requests_running", lambda v: v == LONG_STEP_SEQUENCES, timeout_s=120)
        # The router is in the step that prefills the last of them (its stats went out just before it).
        accepted = server.metrics()["mmserve_requests_total"]
        images = {"images": [{"type": "base64", "data": cached}]}
        send_and_hang_up(server, {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}, "multimodal_params": images})
        server.wait_metric("mmserve_requests_total", lambda v: v == accepted + 1)  # sent to the router
        two = "USER: <image>\n<image>\nAnd these? ASSISTANT:"  # as many new images as the cache holds
        newcomer = pool.submit(ask, server, image_b64(41), image_b64(42), prompt=two)
        assert long.result().status_code == 200, long.result().text
        assert newcomer.result().status_code == 200, newcomer.result().text
    assert ask(server, cached).status_code == 200
    server.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v == 0)
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    log = server.log()
    assert "FileNotFoundError" not in log and "no longer in the embedding cache" not in log
