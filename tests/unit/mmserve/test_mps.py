"""The server's own CUDA MPS daemon (mmserve/launch/mps.py): when it applies, its fallback and one-line refusal, and
the sweep of a dead server's daemon. NVIDIA's control binary is stood in for by a script that records what it is
asked (no GPU here); the real daemon is exercised on the GPU host (docs/performance.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.launch import mps, processes
from mmserve.launch.config import ServerConfig
from mmserve.launch.preflight import CannotStart

_FAKE_CONTROL = """#!/bin/sh
if [ "$1" = "-d" ]; then
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"; exit 0
fi
read command; echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
"""


@pytest.fixture
def control(tmp_path, monkeypatch) -> Path:
    """A stand-in nvidia-cuda-mps-control first on PATH, a GPU node that exists, no MPS of the user's; returns the
    log of what the stand-in was asked."""
    bin_dir, log = tmp_path / "bin", tmp_path / "control.log"
    bin_dir.mkdir()
    script = bin_dir / mps.CONTROL
    script.write_text(_FAKE_CONTROL)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "GPU_NODE", str(script))
    log.write_text("")
    return log


def multimodal(**overrides) -> ServerConfig:
    return ServerConfig(enable_multimodal=True, **overrides)


def test_mps_applies_only_to_a_multimodal_server_on_one_gpu(control, monkeypatch):
    assert mps.why_not_mps(multimodal()) is None
    assert mps.why_not_mps(multimodal(cuda_mps="off")) == "--cuda_mps off"
    assert "no --enable_multimodal" in mps.why_not_mps(ServerConfig())
    assert "--tp above 1" in mps.why_not_mps(multimodal(tp=2))
    assert mps.why_not_mps(multimodal(device="cpu")) == "--device cpu"
    monkeypatch.setattr(mps, "GPU_NODE", "/nonexistent/nvidiactl")
    assert mps.why_not_mps(multimodal()) == "no NVIDIA GPU on this host"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert mps.why_not_mps(multimodal()) == f"no {mps.CONTROL} on PATH"


def test_auto_runs_without_mps_when_no_context_can_connect(control, caplog):
    """No GPU here, so the client check fails: the daemon that was started is stopped, its directories removed, and
    the children would start without the daemon's environment."""
    with caplog.at_level("WARNING", logger="mmserve"):
        assert mps.start_mps(multimodal()) is None
    root = Path(mps.tempfile.gettempdir()) / f"mmsv-mps-{os.getpid()}"
    assert control.read_text().split() == ["start", str(root / "pipe"), "quit", "-t", "5", str(root / "pipe")]
    assert not root.exists()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert "running without CUDA MPS: a CUDA context under it failed" in caplog.text


def test_auto_runs_without_mps_where_its_directories_cannot_be_made(control, monkeypatch, caplog):
    monkeypatch.setattr(mps.tempfile, "gettempdir", lambda: "/dev/null/tmp")
    with caplog.at_level("WARNING", logger="mmserve"):
        assert mps.start_mps(multimodal()) is None
    assert "running without CUDA MPS: cannot make its directories" in caplog.text
    assert control.read_text() == ""


def test_on_refuses_to_start_in_one_line(control, monkeypatch):
    with pytest.raises(CannotStart, match="^--cuda_mps on: a CUDA context under it failed") as failed:
        mps.start_mps(multimodal(cuda_mps="on"))
    assert "\n" not in str(failed.value)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CannotStart, match=f"^--cuda_mps on: no {mps.CONTROL} on PATH$"):
        mps.start_mps(multimodal(cuda_mps="on"))


def test_a_users_own_mps_daemon_is_theirs(control, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    assert mps.start_mps(multimodal(cuda_mps="on")) is None
    assert control.read_text() == ""  # nothing started, nothing stopped


def test_the_sweep_stops_only_a_dead_servers_daemon(control, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead, alive = tmp_path / f"mmsv-mps-{child.pid}", tmp_path / f"mmsv-mps-{os.getpid()}"
    for root in (dead, alive):
        (root / "pipe").mkdir(parents=True)
        (root / "pipe" / "control").write_text("")
    assert mps.remove_dead_mps(str(tmp_path)) == [dead.name]
    assert control.read_text().split() == ["quit", "-t", "5", str(dead / "pipe")]
    assert not dead.exists() and alive.exists()


def test_a_daemon_that_does_not_quit_is_killed_with_its_session(monkeypatch):
    lingering = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert mps._session_of(lingering.pid) == lingering.pid
        assert mps._session_pids(lingering.pid) == []  # not an MPS process: never waited for, nor killed
        assert mps._session_pids(lingering.pid, "sleep") == [lingering.pid]
        monkeypatch.setattr(mps, "_GONE_S", 0.2)
        mps._end_session(lingering.pid, "sleep")
        assert lingering.wait(5) == -9
        assert mps._session_pids(lingering.pid, "sleep") == []
    finally:
        lingering.kill()


def _report_environment(ready) -> None:
    ready.send(("ready", os.environ.get("MMSV_CHILD_ONLY")))
    ready.close()


def test_the_daemons_environment_is_the_childrens_not_the_servers(monkeypatch):
    """The server's own process never becomes a client of the daemon (one would hold up its quit)."""
    monkeypatch.setattr(processes, "_child_environment", {})
    monkeypatch.delenv("MMSV_CHILD_ONLY", raising=False)
    processes.set_child_environment({"MMSV_CHILD_ONLY": "pipe-dir"})
    child = processes.spawn_child("probe", _report_environment)
    try:
        processes.wait_ready([child], 60)
        assert child.info == "pipe-dir"
        assert "MMSV_CHILD_ONLY" not in os.environ
    finally:
        processes.stop_children([child])
