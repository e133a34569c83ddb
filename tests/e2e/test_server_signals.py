"""Stopping the server as service managers do: systemd (KillMode=control-group) and a shell wrapper under
`docker stop` signal the whole process group, not only the server's parent. A single SIGTERM to the group drains
(the request in flight completes, the server exits 0, no child is taken for dead); a second signal stops at once,
ending the streams in flight with an error event; SIGKILL of the group leaves nothing in /dev/shm that the next
start does not remove."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, descendants, pid_alive

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return build_llava_hf(str(tmp_path_factory.mktemp("llava")))


def start_multimodal(model_dir: str, log_path) -> ServerProcess:
    # KV for the drained requests below; a loaded CI host may take long to drain them
    args = ("--max_total_token_num", "8192", "--enable_multimodal", "--graceful_timeout", "120")
    srv = ServerProcess(model_dir, str(log_path), *args, new_session=True)
    srv.wait_healthy()
    return srv


def ask_image(srv: ServerProcess, seed: int) -> httpx.Response:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 4},
        "multimodal_params": {"images": [{"type": "base64", "data": png_b64(picture(40, 30, seed))}]},
    }
    return httpx.post(srv.url + "/generate", json=body, timeout=60)


def semaphores_of(pids: list[int]) -> set[str]:
    """The POSIX named semaphores (/dev/shm/sem.*) these processes have mapped: exactly the server's own, whatever
    other processes on the host create meanwhile."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split()[-1] for line in f if "/dev/shm/sem." in line and "(deleted)" not in line)
        except OSError:
            continue
    return names


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_sigkill_of_the_group_is_swept_by_the_next_start_and_sigterm_to_the_group_drains(llava_dir, tmp_path):
    dead = start_multimodal(llava_dir, tmp_path / "killed.log")
    try:
        assert ask_image(dead, 1).status_code == 200  # the preprocessing pool has worked
        tree = [dead.proc.pid, *descendants(dead.proc.pid)]
        semaphores = semaphores_of(tree)
        assert semaphores  # the preprocessing pool's queues: what a SIGKILL leaves behind
        os.killpg(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)
        wait_gone(tree)
    finally:
        if dead.proc.poll() is None:
            dead.stop(signal.SIGKILL)
    srv = start_multimodal(llava_dir, tmp_path / "server.log")
    try:
        assert sorted(s for s in semaphores if os.path.exists(s)) == []
        drain_on_group_sigterm(srv)
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
    assert srv.leftover_children() == []
    log = srv.log()
    assert "Traceback" not in log
    assert "restart" not in log and "exited" not in log, log  # the visual process was not taken for dead


def drain_on_group_sigterm(srv: ServerProcess) -> None:
    """SIGTERM to the whole group while a stream and a /generate run: both complete, then the server exits 0."""
    # Long enough to run together through a stall of the server: with cold bytecode caches its first /metrics after
    # the /generate arrived once came back 2.6 s late, when 1500 tokens each had nearly ended.
    longer = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
    long = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 3000, "ignore_eos": True}}
    result = {}
    poster = threading.Thread(target=lambda: result.update(r=httpx.post(srv.url + "/generate", json=long, timeout=120)))
    with httpx.stream("POST", srv.url + "/generate_stream", json=longer, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data:")  # streaming has begun
        poster.start()
        srv.wait_metric("mmserve_requests_running", lambda v: v >= 2)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    poster.join(120)
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "length", (events[-1], srv.log())
    assert result["r"].status_code == 200, result["r"].text
    assert srv.proc.wait(30) == 0, srv.log()


def test_a_second_signal_stops_at_once_and_ends_the_streams_with_an_error_event(e2e_model_dir, tmp_path):
    # The KV cache (2048) is smaller than the model's context (4096): the limit the log tells is the smaller one.
    args = ("--max_total_token_num", "2048", "--graceful_timeout", "120", "--log_level", "info")
    srv = ServerProcess(e2e_model_dir, str(tmp_path / "server.log"), *args, new_session=True)
    srv.wait_healthy()
    tree = [srv.proc.pid, *descendants(srv.proc.pid)]
    try:
        long = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
        with httpx.stream("POST", srv.url + "/generate_stream", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
            os.killpg(srv.proc.pid, signal.SIGTERM)
            while httpx.get(srv.url + "/health", timeout=5).status_code == 200:  # draining begun
                time.sleep(0.02)
            second_at = time.monotonic()
            os.killpg(srv.proc.pid, signal.SIGINT)  # Ctrl-C after a SIGTERM, as an impatient operator does
            events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "error", events[-1]
        assert "second signal" in events[-1]["error"]
        code = srv.proc.wait(10)
        took = time.monotonic() - second_at
        wait_gone(tree)
        assert took < 3.0, srv.log()
        assert not [p for p in tree if pid_alive(p)]
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
    log = srv.log()
    assert code == 0 and "exiting after a failure" not in log, log  # the first SIGTERM drained: no child died
    assert "requests up to 2048 tokens" in log
