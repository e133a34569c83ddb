"""After a crash: a server start removes the shared-memory segments that dead servers left in /dev/shm (their names
carry the server's pid), and never a live server's."""

from __future__ import annotations

import _posixshmem
import os
import subprocess
import sys

import torch

from cache.shm_store import list_segments, new_prefix, remove_dead_segments, unlink_all, write_embedding
from visual.pids import pid_alive
from visual.shared_pixels import share_tensor


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def make_segment(name: str) -> None:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    os.ftruncate(fd, 64)
    os.close(fd)


def test_the_prefix_carries_the_owner_pid():
    assert new_prefix().startswith(f"mmsv_{os.getpid()}_")


def test_dead_servers_segments_go_and_live_ones_stay():
    pid = dead_pid()
    dead_prefix = f"mmsv_{pid}_0badc0de_"
    live_prefix = new_prefix()  # this process: alive
    other = f"mmsvx_{pid}_notours"  # not a name new_prefix() makes
    try:
        write_embedding(dead_prefix, "key1", torch.zeros(2, 3))  # an embedding
        share_tensor(torch.ones(4), dead_prefix)  # a preprocessing pool's pixel segment
        write_embedding(live_prefix, "key1", torch.zeros(2, 3))
        share_tensor(torch.ones(4), live_prefix)
        make_segment(other)
        assert len(list_segments(dead_prefix)) == 2 and len(list_segments(live_prefix)) == 2

        removed = remove_dead_segments()

        assert list_segments(dead_prefix) == [] and set(removed) >= {f"{dead_prefix}key1"}
        assert len([n for n in removed if n.startswith(dead_prefix)]) == 2
        assert len(list_segments(live_prefix)) == 2 and not [n for n in removed if n.startswith(live_prefix)]
        assert list_segments(other) == [other]
    finally:
        unlink_all(dead_prefix)
        unlink_all(live_prefix)
        unlink_all(other)


def test_a_live_process_of_another_user_or_pid_1_is_alive():
    assert pid_alive(1) and pid_alive(os.getpid()) and pid_alive(0)
