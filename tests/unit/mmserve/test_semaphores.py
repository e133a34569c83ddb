"""Semaphores named after their server, and the sweep of a dead server's (mmserve/launch/semaphores.py)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.process
import os
import subprocess
import sys
from multiprocessing import synchronize

from mmserve.launch.semaphores import name_semaphores_after, remove_dead_semaphores
from visual import preprocess


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_multiprocessing_names_semaphores_after_the_server():
    config = multiprocessing.process.current_process()._config
    before = config["semprefix"]
    try:
        name_semaphores_after(4242)
        lock = mp.get_context("spawn").Lock()
        assert lock._semlock.name.startswith("/mp-mmsv_4242-")
        del lock
    finally:
        config["semprefix"] = before


def _lokys_name() -> str:
    return f"/loky-{os.getpid()}-x{next(synchronize.SemLock._rand)}"


def test_the_preprocessing_pool_names_its_semaphores_after_the_server_though_loky_renamed_them(monkeypatch):
    """joblib's loky, imported with scikit-learn (transformers imports it where it is installed), replaces
    multiprocessing's naming with its own for the whole process; the pool's queues and barrier must still carry the
    server's name, or a SIGKILL leaves them in /dev/shm for good."""
    config = multiprocessing.process.current_process()._config
    monkeypatch.setitem(config, "semprefix", config["semprefix"])
    name_semaphores_after(4243)
    monkeypatch.setattr(synchronize.SemLock, "_make_name", staticmethod(_lokys_name))  # what importing loky does
    assert mp.get_context("spawn").Lock()._semlock.name.startswith("/loky-")  # (the stand-in does rename)
    barrier = preprocess._fork_server_context().Barrier(2)  # how the pool starts its workers together
    assert barrier._cond._lock._semlock.name.startswith("/mp-mmsv_4243-")


def test_the_sweep_removes_only_a_dead_servers_semaphores(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    names = [f"sem.mp-mmsv_{dead}-a1", f"sem.mp-mmsv_{alive}-b2", "sem.mp-c3", f"mmsv_{dead}_segment"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert remove_dead_semaphores(str(tmp_path)) == [f"sem.mp-mmsv_{dead}-a1"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
