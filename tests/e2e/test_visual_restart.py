"""The visual process is supervised (tiny random LLaVA, CPU): when it is SIGKILLed mid-load, the image requests
waiting on it answer 503 within seconds, a request whose image is cached and a text request are served meanwhile,
/health says "degraded", and the restarted process serves new images again; one that cannot restart makes the
server exit non-zero."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import httpx
import pytest

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, child_pids

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_llava_hf(str(tmp_path_factory.mktemp("llava")))


def start(model_dir: str, log_path, *args: str) -> ServerProcess:
    return ServerProcess(model_dir, str(log_path), "--max_total_token_num", "2048", "--enable_multimodal", *args)


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def visual_pid(srv: ServerProcess) -> int:
    return next(p for p in child_pids(srv.proc.pid) if comm(p) == "mmserve-visual")


def ask_image(srv: ServerProcess, seed: int, timeout: float = 60) -> httpx.Response:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 4},
        "multimodal_params": {"images": [{"type": "base64", "data": png_b64(picture(40, 30, seed))}]},
    }
    return httpx.post(srv.url + "/generate", json=body, timeout=timeout)


def health(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/health", timeout=5).json()


def test_visual_process_sigkilled_mid_load_is_restarted_and_one_that_cannot_restart_stops_the_server(
    model_dir, tmp_path
):
    model = shutil.copytree(model_dir, tmp_path / "model")
    srv = start(str(model), tmp_path / "server.log", "--visual_max_restarts", "2")
    try:
        srv.wait_healthy()
        killed_at = sigkill_mid_load(srv)
        wait_restarted(srv, killed_at)
        srv.children = child_pids(srv.proc.pid)  # with the restarted process: it must be gone after the exit too
        # Again, but now it cannot start: one failed restart (2 in a row with the kill) > 2 ... the server exits.
        (model / "config.json").write_text("{")  # the router and the HTTP side have read it; a new process fails
        os.kill(visual_pid(srv), signal.SIGKILL)
        assert srv.proc.wait(60) != 0
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    assert srv.leftover_children(grace_s=15) == []  # its resource tracker may take a while on a loaded machine
    log = srv.log()
    assert "failed to restart" in log and "giving up" in log
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{srv.proc.pid}_")]


def sigkill_mid_load(srv: ServerProcess) -> float:
    """Kill the visual process while three image requests wait on it and a text stream runs: those three get a
    prompt 503; a cached image, a text request and the stream are served. Returns when it was killed."""
    assert ask_image(srv, 0).status_code == 200  # image 0 is cached from now on
    victim = visual_pid(srv)
    os.kill(victim, signal.SIGSTOP)  # stuck: the requests below wait on their encodings
    answers: dict[int, tuple[int, str, float]] = {}

    def send(seed: int) -> None:
        r = ask_image(srv, seed)
        answers[seed] = (r.status_code, r.text, time.monotonic())

    waiting = [threading.Thread(target=send, args=(seed,)) for seed in (1, 2, 3)]
    for t in waiting:
        t.start()
    srv.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v >= 3)  # all three wait on the visual process
    long = {"inputs": "Hello", "parameters": {"max_new_tokens": 200, "ignore_eos": True}}
    with httpx.stream("POST", srv.url + "/generate_stream", json=long, timeout=60) as text_stream:
        lines = text_stream.iter_lines()
        assert next(lines).startswith("data:")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for t in waiting:
            t.join(30)
        for seed in (1, 2, 3):
            status, text, at = answers[seed]
            assert status == 503 and "visual process" in json.loads(text)["error"], text
            assert at - killed_at < 5.0
        state = health(srv)
        assert state["status"] == "degraded" and "visual process" in state["error"], state
        assert srv.metrics()["mmserve_visual_up"] == 0
        cached = ask_image(srv, 0)  # needs no encoding: served while the visual process is down
        assert cached.status_code == 200, cached.text
        text = httpx.post(srv.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
        assert text.status_code == 200
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert events[-1]["finish_reason"] == "length"  # the text stream in flight was not disturbed
    return killed_at


def wait_restarted(srv: ServerProcess, killed_at: float) -> None:
    """New images are served again within a minute of the kill, by a new process."""
    seed = 100
    while (r := ask_image(srv, seed)).status_code != 200:  # a new image: needs the restarted process
        assert r.status_code == 503 and time.monotonic() < killed_at + 60, r.text
        assert int(r.headers["retry-after"]) > 0
        time.sleep(0.2)
        seed += 1
    assert health(srv)["status"] == "ok"
    m = srv.metrics()
    assert m["mmserve_visual_up"] == 1 and m["mmserve_visual_restarts_total"] == 1
    assert ask_image(srv, 1).status_code == 200  # an image whose encoding was lost is encoded again
    assert srv.metrics()["mmserve_embed_cache_items_in_use"] == 0
