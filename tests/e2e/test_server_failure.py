"""A child process that dies takes the server down promptly and cleanly: in-flight requests get 5xx, /health stops
answering 200, the server exits non-zero, and no process is left behind (a tensor-parallel rank: test_tp_server,
with this module's kill_child_mid_load). Also: a clean stop by SIGINT, and the graceful stop on SIGTERM (a request
in flight completes, new ones get 503 with Retry-After, the server exits 0)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time

import httpx
import pytest

from mmserve.testing.server_proc import ServerProcess


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def start(model_dir: str, tmp_path, *args: str) -> ServerProcess:
    srv = ServerProcess(model_dir, str(tmp_path / "server.log"), "--max_total_token_num", "8192", *args)
    srv.wait_healthy()
    return srv


def kill_child_mid_load(srv: ServerProcess, victim: str) -> None:
    """SIGKILL the child process named `victim` while two long requests run: the non-streamed one gets a 5xx JSON
    answer within 5 s, the stream ends with an error event, /health fails, the server exits non-zero within 30 s
    and leaves no process behind."""
    try:
        pid = next(p for p in srv.children if comm(p) == victim)
        long = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}  # ~10 s each
        result = {}

        def post():
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/generate", json=long, timeout=60)
            result.update(status=r.status_code, body=r.json(), at=time.monotonic())
            result["took"] = result["at"] - t0

        with httpx.stream("POST", srv.url + "/generate_stream", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")  # streaming has begun
            poster = threading.Thread(target=post)
            poster.start()
            srv.wait_metric("mmserve_requests_running", lambda v: v >= 2)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        poster.join(30)
        # the non-streamed request: a 5xx JSON answer, promptly
        assert 500 <= result["status"] < 600 and "error" in result["body"]
        assert result["at"] - killed_at < 5.0
        # the stream (already 200) ends with an error event instead of hanging
        assert events and events[-1]["finished"] and events[-1]["finish_reason"] == "error"
        try:
            assert httpx.get(srv.url + "/health", timeout=5).status_code != 200
        except httpx.TransportError:
            pass  # already gone: not healthy either
        code = srv.proc.wait(30)
        assert code != 0
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert srv.leftover_children() == []


@pytest.mark.parametrize("victim", ["mmserve-router", "mmserve-detoken"])
def test_dead_child_fails_requests_and_stops_the_server(e2e_model_dir, tmp_path, victim):
    """A tensor-parallel rank (mmserve-tp1) is killed the same way in test_tp_server, on its --tp 2 server."""
    kill_child_mid_load(start(e2e_model_dir, tmp_path), victim)


def test_sigint_stops_every_process(e2e_model_dir, tmp_path):
    srv = start(e2e_model_dir, tmp_path)
    assert len(srv.children) >= 2
    assert (
        httpx.post(srv.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    )
    assert srv.stop(signal.SIGINT) == 0
    assert srv.leftover_children() == []
    assert "Traceback" not in srv.log()


def wait_draining(srv: ServerProcess, timeout_s: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while (r := httpx.get(srv.url + "/health", timeout=5)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    return r


def ipc_dirs(pid: int) -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"mmserve-ipc-{pid}-")]


def test_sigterm_lets_a_request_in_flight_complete_refuses_new_ones_and_exits_0(e2e_model_dir, tmp_path):
    srv = start(e2e_model_dir, tmp_path, "--graceful_timeout", "120")  # ample on a loaded CI machine
    assert len(ipc_dirs(srv.proc.pid)) == 1
    try:
        long = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}  # a few s
        with httpx.stream("POST", srv.url + "/generate_stream", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")  # streaming has begun
            srv.proc.send_signal(signal.SIGTERM)
            health = wait_draining(srv)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            ready = httpx.get(srv.url + "/readiness", timeout=5)  # LightLLM's probes: not ready, yet alive
            assert ready.status_code == 503 and ready.json()["status"] == "not ready"
            assert httpx.get(srv.url + "/healthz", timeout=5).json()["message"] == "Error"
            assert httpx.get(srv.url + "/liveness", timeout=5).json() == {"status": "ok"}
            refused = httpx.post(srv.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
            assert "shutting down" in refused.json()["error"]
            assert srv.proc.poll() is None  # still draining
            events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "length", (events[-1], srv.log())
        assert events[-1]["token"]["count_output_tokens"] == 1000
        assert srv.proc.wait(30) == 0
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    assert srv.leftover_children() == []
    assert ipc_dirs(srv.proc.pid) == []  # its sockets are gone
    assert "Traceback" not in srv.log()


def test_sigterm_ends_what_outlasts_graceful_timeout_and_exits_0(e2e_model_dir, tmp_path):
    srv = start(e2e_model_dir, tmp_path, "--graceful_timeout", "1")
    try:
        long = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}  # ~10 s
        with httpx.stream("POST", srv.url + "/generate_stream", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
            stopped_at = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "error"  # ended, not left hanging
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - stopped_at < 10
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
    assert srv.leftover_children() == []
    assert ipc_dirs(srv.proc.pid) == []
