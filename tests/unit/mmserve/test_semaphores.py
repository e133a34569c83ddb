"""Semaphores named after their server, and the sweep of a dead server's (mmserve/launch/semaphores.py)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.process
import os
import subprocess
import sys

from mmserve.launch.semaphores import name_semaphores_after, remove_dead_semaphores


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


def test_the_sweep_removes_only_a_dead_servers_semaphores(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    names = [f"sem.mp-mmsv_{dead}-a1", f"sem.mp-mmsv_{alive}-b2", "sem.mp-c3", f"mmsv_{dead}_segment"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert remove_dead_semaphores(str(tmp_path)) == [f"sem.mp-mmsv_{dead}-a1"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
