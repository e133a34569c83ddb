"""After a crash, sockets too: a server's zmq ipc directory carries its pid, and a server start removes the
directories of servers whose pid is dead, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys

from mmserve.ipc.endpoints import Endpoints, remove_dead_ipc_dirs
from visual.pids import pid_alive


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def test_the_ipc_dir_carries_the_owner_pid_and_remove_deletes_it(tmp_path):
    endpoints = Endpoints.create(str(tmp_path))
    assert os.path.basename(endpoints.root).startswith(f"mmserve-ipc-{os.getpid()}-")
    assert endpoints.router == f"ipc://{endpoints.root}/router.sock"
    endpoints.remove()
    assert not os.path.exists(endpoints.root)


def test_dead_servers_ipc_dirs_go_and_live_ones_stay(tmp_path):
    pid = dead_pid()
    dead = tmp_path / f"mmserve-ipc-{pid}-abc123"
    dead.mkdir()
    (dead / "router.sock").write_bytes(b"")  # a socket file left behind
    live = Endpoints.create(str(tmp_path))  # this process: alive
    old_style = tmp_path / "mmserve-ipc-k2j4h5"  # before names carried a pid: whose it is cannot be told
    old_style.mkdir()
    not_a_dir = tmp_path / f"mmserve-ipc-{pid}-file"
    not_a_dir.write_bytes(b"")
    other = tmp_path / f"other-ipc-{pid}-x"
    other.mkdir()

    assert remove_dead_ipc_dirs(str(tmp_path)) == [str(dead)]

    assert not dead.exists()
    assert os.path.isdir(live.root) and old_style.is_dir() and not_a_dir.is_file() and other.is_dir()
    live.remove()


def test_a_missing_parent_removes_nothing(tmp_path):
    assert remove_dead_ipc_dirs(str(tmp_path / "absent")) == []
