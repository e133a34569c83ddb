"""--enable_multimodal wiring: the visual process, the shared-memory cache and the router's embedding reads, on a
tiny random LLaVA (llava-hf layout). Equality with HF is tested with the families (tests/models); this checks the
server around them."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.checkpoints.llava import build_llava_hf
from tests.e2e.server_proc import ServerProcess, serving

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"


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
        "2048",
        "--enable_multimodal",
        "--cache_capacity",
        "2",
    )
    with serving(srv):
        yield srv


def ask(server, *images: str, **parameters) -> httpx.Response:
    body = {
        "inputs": PROMPT,
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
    assert a == b and a_lps == pytest.approx(b_lps, abs=1e-4)
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
