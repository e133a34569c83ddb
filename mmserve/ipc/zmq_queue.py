"""Typed one-way queues between processes over zmq PUSH/PULL on ipc:// sockets.

The PULL side binds (it owns the address), any number of PUSH sides connect. Only the small dataclasses of
`mmserve.ipc.messages` (and the engine's plain records they carry) are accepted: a send of anything else fails
loudly instead of pickling a tensor by accident.
"""

from __future__ import annotations

import pickle

import zmq
import zmq.asyncio

from mmserve.ipc import messages

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
