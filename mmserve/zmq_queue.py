"""Typed one-way queues between processes over zmq PUSH/PULL on ipc:// sockets.

The PULL side binds (it owns the address), any number of PUSH sides connect. Only the small dataclasses of
`mmserve.messages` are accepted: a send of anything else fails loudly instead of pickling a tensor by accident.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from cache.shm_store import pid_alive
from mmserve import messages

_ALLOWED = (
    messages.TokenizedRequest,
    messages.AbortRequest,
    messages.ImagesReady,
    messages.RouterBatch,
    messages.DetokBatch,
)
# Queues are effectively unbounded: back-pressure belongs to the scheduler, and a blocked send on the HTTP event
# loop would stall every client.
_HWM = 1_000_000
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
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        owner = _IPC_OWNER.match(name)
        path = os.path.join(parent, name)
        if owner is None or pid_alive(int(owner.group(1))):
            continue
        try:
            if not os.path.isdir(path) or os.path.islink(path) or os.stat(path).st_uid != os.getuid():
                continue
            shutil.rmtree(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed


def _check(msg: object) -> bytes:
    if not isinstance(msg, _ALLOWED):
        raise TypeError(f"{type(msg).__name__} is not a process message")
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _socket(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.connect(addr)
    else:
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.bind(addr)
    return sock


class PushQueue:
    def __init__(self, ctx: zmq.Context, addr: str):
        self._sock = _socket(ctx, zmq.PUSH, addr)

    def send(self, msg: object) -> None:
        self._sock.send(_check(msg))

    def close(self) -> None:
        self._sock.close()


class PullQueue:
    def __init__(self, ctx: zmq.Context, addr: str):
        self._sock = _socket(ctx, zmq.PULL, addr)

    def recv(self, timeout_ms: int | None) -> object | None:
        """The next message, waiting up to timeout_ms (None: forever, 0: not at all); None if there is none."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms):
            return None
        return pickle.loads(self._sock.recv())

    def drain(self, timeout_ms: int | None) -> list[object]:
        """Everything queued now, after waiting up to timeout_ms for the first message."""
        first = self.recv(timeout_ms)
        if first is None:
            return []
        out = [first]
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self._sock.close()


class AsyncPushQueue:
    """For the HTTP server's event loop: never blocks (the high-water mark is effectively unbounded)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str):
        self._sock = _socket(ctx, zmq.PUSH, addr)

    def send_nowait(self, msg: object) -> None:
        self._sock.send(_check(msg), flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close()


class AsyncPullQueue:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str):
        self._sock = _socket(ctx, zmq.PULL, addr)

    async def recv(self) -> object:
        return pickle.loads(await self._sock.recv())

    def close(self) -> None:
        self._sock.close()
