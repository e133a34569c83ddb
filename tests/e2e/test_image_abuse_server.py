"""Abuse and crashes through a real server (tiny random Qwen2-VL, CPU): the image caps answer 400s that name their
flags (LightLLM's JSON and the OpenAI API), a decompression bomb is refused, a 2-frame GIF is answered as its frame
0 and an RGBA image as HF's processor sees it (on white), and after a SIGKILL of the whole server the next start
removes the dead server's shared-memory segments and ipc socket directory."""

from __future__ import annotations

import base64
import io
import os
import signal
import struct
import tempfile
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.checkpoints.qwen2_vl_demo import CHAT_TEMPLATE
from tests.e2e.server_proc import ServerProcess

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
                        "--chat_template", str(tmp / "chat.jinja"))  # fmt: skip
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
    rgba = picture(50, 40, 3, channels=4)
    on_white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    ours = answer(server, [item(encode(rgba))])
    assert ours == answer(server, [item(encode(on_white))])
    assert ours != answer(server, [item(encode(rgba.convert("RGB")))])  # alpha dropped: what HF does not do


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
