"""Abuse and crashes through a real server (tiny random Qwen2-VL, CPU): the image caps answer 400s that name their
flags (LightLLM's JSON and the OpenAI API), a decompression bomb is refused, so is an aspect ratio beyond what HF's
processor accepts, a 2-frame GIF is answered as its frame 0 and an RGBA image as HF's processor sees it (on white),
image URLs keep their deadline and cannot starve other clients, a killed preprocessing worker costs its images a
503 (not a 500, and not the server), and after a SIGKILL of the whole server the next start removes the dead
server's shared-memory segments and ipc socket directory."""

from __future__ import annotations

import base64
import io
import os
import signal
import struct
import tempfile
import threading
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.checkpoints.qwen2_vl_demo import CHAT_TEMPLATE
from mmserve.testing.server_proc import ServerProcess, child_pids
from tests.fake_image_host import hostile_host, wait_for_requests

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_PIXELS = 40_000


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def picture(width: int, height: int, seed: int, channels: int = 3) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA" if channels == 4 else "RGB")


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = zlib.compress(b"\x00" * 16)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk
        + struct.pack(">I", len(idat))
        + b"IDAT"
        + idat
        + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    )


def item(data: bytes) -> dict:
    return {"type": "base64", "data": base64.b64encode(data).decode()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abuse")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)  # the tiny checkpoint has none; the OpenAI API needs one
    srv = ServerProcess(model_dir, str(tmp / "server.log"), "--max_total_token_num", "4096", "--enable_multimodal",
                        "--max_images_per_request", "2", "--max_image_pixels", str(MAX_PIXELS),
                        "--chat_template", str(tmp / "chat.jinja"), "--allow_private_urls")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        if srv.proc.poll() is None:  # the last test kills it outright
            assert srv.stop() == 0, srv.log()


def generate(server, images: list[dict], new_tokens: int = 6) -> httpx.Response:
    body = {
        "inputs": CHAT.format(VISION * len(images) + "Describe."),
        "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": images},
    }
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def answer(server, images: list[dict]) -> list[tuple[int, float]]:
    r = generate(server, images)
    assert r.status_code == 200, r.text
    return [(t["id"], t["logprob"]) for t in r.json()["tokens"]]


def test_caps_answer_400s_that_name_their_flags(server):
    three = [item(encode(picture(20, 20, i))) for i in range(3)]
    r = generate(server, three)
    assert r.status_code == 400, r.text
    assert "3 images in one request, more than the limit of 2 (--max_images_per_request)" in r.json()["error"]
    assert r.json()["field"] == "multimodal_params.images"

    r = generate(server, [item(encode(picture(250, 200, 0)))])  # 50,000 px
    assert r.status_code == 400 and "--max_image_pixels" in r.json()["error"], r.text
    assert f"250x200 = 50000 pixels, more than the limit of {MAX_PIXELS}" in r.json()["error"]
    assert r.json()["field"] == "multimodal_params.images[0]"

    start = time.monotonic()
    r = generate(server, [item(bomb_png())])  # 60 bytes declaring 10^10 pixels
    assert r.status_code == 400 and "--max_image_pixels" in r.json()["error"], r.text
    assert time.monotonic() - start < 10

    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + i["data"]}} for i in three]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": server_model(server), "max_tokens": 4,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "Compare."}]}]})  # fmt: skip
    assert r.status_code == 400 and "--max_images_per_request" in r.text, r.text

    assert len(answer(server, three[:2])) == 6  # at the caps: served
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def server_model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_two_frame_gif_is_answered_as_its_frame_0(server):
    first, second = picture(60, 40, 1).quantize(16), picture(60, 40, 2).quantize(16)
    gif = encode(first, "GIF", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    ours = answer(server, [item(gif)])
    assert ours == answer(server, [item(encode(first, "GIF"))])  # the same pixels in another file: equal logprobs
    assert ours != answer(server, [item(encode(second, "GIF"))])


def test_an_rgba_image_is_seen_on_white_as_hf_processors_see_it(server):
    """transformers' convert_to_rgb composites transparency onto white (from 5.2x; before, it dropped the alpha
    channel as PIL does): the server sees an RGBA image as the installed transformers' processors do."""
    rgba = picture(50, 40, 3, channels=4)
    on_white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    alpha_dropped = rgba.convert("RGB")
    seen, not_seen = (on_white, alpha_dropped) if hf_composites_onto_white() else (alpha_dropped, on_white)
    ours = answer(server, [item(encode(rgba))])
    assert ours == answer(server, [item(encode(seen))])
    assert ours != answer(server, [item(encode(not_seen))])


def hf_composites_onto_white() -> bool:
    """Whether the installed transformers' convert_to_rgb turns a clear pixel white (a PIL image back, whatever the
    version; newer ones warn that this return is deprecated)."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    return np.asarray(convert_to_rgb(clear))[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("width, height", [(1, 4000), (4000, 1), (3, 700)])
def test_an_aspect_ratio_beyond_200_is_refused_with_a_400_that_says_why(server, width, height):
    """HF's Qwen2-VL processor (smart_resize) refuses an aspect ratio above 200:1: the server says so before it
    expands the prompt or encodes anything (the request used to end in a 500)."""
    r = generate(server, [item(encode(picture(width, height, 4)))])
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "multimodal_params.images[0]"
    ratio = max(width, height) / min(width, height)
    assert f"{width}x{height}" in r.json()["error"] and f"aspect ratio {ratio:.0f}:1" in r.json()["error"]
    assert "above 200:1" in r.json()["error"], r.text
    url = "data:image/png;base64," + item(encode(picture(width, height, 4)))["data"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": server_model(server), "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})  # fmt: skip
    assert r.status_code == 400 and "above 200:1" in r.text, r.text
    assert len(answer(server, [item(encode(picture(1, 200, 5)))])) == 6  # 200:1 is allowed
    assert server.metrics()["mmserve_embed_cache_items_in_use"] == 0


def test_an_unreadable_image_is_named_without_python_internals(server):
    r = generate(server, [item(b"this is not an image")])
    assert r.status_code == 400, r.text
    assert "not a readable image" in r.json()["error"]
    assert "0x" not in r.json()["error"] and "BytesIO" not in r.json()["error"], r.text


def url_item(url: str) -> dict:
    return {"type": "url", "data": url}


def test_image_urls_keep_their_deadline_and_cannot_starve_other_clients(server):
    """A host that trickles its headers a byte at a time is cut off at the fetch's 10 s deadline (not held for as
    long as it keeps sending), and while 16 clients wait on never-answering URLs (2 each, more fetches than the
    image threads of any host), another client's base64 image is answered at once."""
    answers: dict[str, list[tuple[int, str, float]]] = {"trickle": [], "hang": []}

    def send(kind: str, images: list[dict]) -> None:
        start = time.monotonic()
        r = generate(server, images, new_tokens=2)
        answers[kind].append((r.status_code, r.text, time.monotonic() - start))

    with hostile_host(trickle_s=0.5) as host:
        clients = [threading.Thread(target=send, args=("trickle", [url_item(host.url + "/trickle")]))]
        clients += [threading.Thread(target=send, args=("hang", [url_item(host.url + "/hang")] * 2)) for _ in range(16)]
        for t in clients:
            t.start()
        wait_for_requests(host, 33, timeout_s=8)  # every fetch is under way at once
        start = time.monotonic()
        assert len(answer(server, [item(encode(picture(30, 20, 6)))])) == 6
        assert time.monotonic() - start < 5
        for t in clients:
            t.join(60)
    ((status, text, took),) = answers["trickle"]
    assert status == 400 and "timed out after 10 s" in text, text
    assert took < 14, took  # the trickle would have gone on for more than two minutes
    assert len(answers["hang"]) == 16
    for status, text, took in answers["hang"]:
        assert status == 400 and "timed out after 10 s" in text and took < 14, (status, text, took)
    assert server.metrics()["mmserve_embed_cache_items_in_use"] == 0


def preprocessing_workers(server) -> list[int]:
    """The visual process's pool workers: the children of its fork server (the visual process's only child with
    children of its own)."""
    visual = next(p for p in child_pids(server.proc.pid) if comm(p) == "mmserve-visual")
    return [worker for child in child_pids(visual) for worker in child_pids(child)]


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def test_a_killed_preprocessing_worker_costs_its_image_a_503_and_the_server_goes_on(server):
    """The pool's workers killed (the OOM killer, an operator) while they hold a request's image: that request gets
    a 503 with Retry-After, not a 500; the pool starts new workers and the next new image is served by the same
    visual process."""
    workers = preprocessing_workers(server)
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # the image below waits in the pool
    result: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: result.append(generate(server, [item(encode(picture(30, 30, 7)))])))
    waiting.start()
    try:
        server.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v >= 1)
        time.sleep(1.0)  # the job has reached the visual process and its pool
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    waiting.join(60)
    (r,) = result
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0 and "retry" in r.json()["error"], r.text
    assert len(answer(server, [item(encode(picture(30, 30, 8)))])) == 6  # a new image: the pool works again
    assert len(answer(server, [item(encode(picture(30, 30, 7)))])) == 6  # and the one that failed, sent again
    assert server.metrics()["mmserve_visual_restarts_total"] == 0  # the visual process itself carried on
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def ipc_dirs(pid: int) -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"mmserve-ipc-{pid}-")]


def test_after_a_sigkill_the_next_start_removes_the_dead_servers_segments(server, model_dir, tmp_path):
    answer(server, [item(encode(picture(30, 30, 9)))])  # at least one embedding in shared memory
    pid = server.proc.pid
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{pid}_")]
    assert left
    server.stop(signal.SIGKILL)
    assert server.leftover_children(grace_s=15) == []  # the children die with it (PR_SET_PDEATHSIG)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{pid}_")]  # nobody cleaned up: SIGKILL
    assert len(ipc_dirs(pid)) == 1  # its sockets neither

    again = ServerProcess(model_dir, str(tmp_path / "again.log"), "--max_total_token_num", "1024",
                          "--enable_multimodal")  # fmt: skip
    try:
        again.wait_healthy()
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{pid}_")] == []
        assert ipc_dirs(pid) == []
        assert len(ipc_dirs(again.proc.pid)) == 1  # its own stays
        assert len(answer(again, [item(encode(picture(30, 30, 9)))])) == 6
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{again.proc.pid}_")]  # its own stay
    finally:
        assert again.stop() == 0, again.log()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{again.proc.pid}_")] == []
    assert ipc_dirs(again.proc.pid) == []  # a normal stop removes its own
    assert "leaked semaphore" not in again.log()  # the visual process's preprocessing pool is stopped cleanly
