"""The ipc addresses of one server's zmq queues (mmserve.ipc.zmq_queue), and the sweep of those that servers killed
outright left behind. Light to import: the server's parent creates them before anything heavy is loaded."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from visual.pids import dead_owners_entries

_IPC_PREFIX = "mmserve-ipc-"
_IPC_OWNER = re.compile(re.escape(_IPC_PREFIX) + r"(\d+)-")  # mmserve-ipc-<pid of the server>-<random>


@dataclass(frozen=True)
class Endpoints:
    """The ipc addresses of one server, in a private temp dir (so two servers on one host never collide), named
    `mmserve-ipc-<pid of the server>-<random>` so that a later start can sweep it if this server is killed
    outright (`remove_dead_ipc_dirs`)."""

    root: str
    router: str  # router's inbox: requests, aborts, image readiness
    detokenizer: str  # detokenizer's inbox: router batches
    http: str  # HTTP server's inbox: text pieces
    visual: str  # visual process's inbox: encode jobs (with --enable_multimodal)
    visual_results: str  # HTTP server's inbox for the visual process's answers

    @classmethod
    def create(cls, parent: str | None = None) -> Endpoints:
        root = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-", dir=parent)
        names = ("router", "detok", "http", "visual", "visual_results")
        return cls(root, *(f"ipc://{os.path.join(root, name)}.sock" for name in names))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def remove_dead_ipc_dirs(parent: str | None = None) -> list[str]:
    """Remove the ipc directories (under `parent`, default the temp dir) of mmserve servers that are no longer
    running, as `cache.shm_store.remove_dead_segments` does for /dev/shm; returns their paths. A live server's,
    another user's and anything not named by Endpoints.create stay."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for name in dead_owners_entries(parent, _IPC_OWNER):
        path = os.path.join(parent, name)
        try:
            if not os.path.isdir(path) or os.path.islink(path) or os.stat(path).st_uid != os.getuid():
                continue
            shutil.rmtree(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed
