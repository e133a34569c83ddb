"""Slow clients cannot pin memory or KV slots.

- A request body must arrive in full within `--request_read_timeout` seconds (an upload that trickles gets a 408
  and its connection is closed): `read_body`.
- A response write that cannot complete within `--stream_write_timeout` seconds (a client that stopped reading:
  the kernel's and uvicorn's send buffers are full) drops the connection; the request's stream then ends, which
  aborts it in the engine and frees its KV slots: `WriteTimeout`, an ASGI wrapper around the whole app.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a request with a few base64 images fits easily


@dataclass(frozen=True)
class ClientTimeouts:
    read_s: float = 60.0  # the whole request body (0: no limit)
    write_s: float = 30.0  # one response write, i.e. how long a client may stop reading a stream (0: no limit)


class BodyTooLarge(Exception):
    pass


class BodyReadTimeout(Exception):
    pass


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The request body, raising BodyTooLarge over MAX_BODY_BYTES and BodyReadTimeout when it has not arrived in
    full within `timeout_s` seconds of the start of the read. One timer covers the whole read: a per-chunk
    `wait_for` made a task for each of a large upload's ~64 KiB chunks, a third of the HTTP process's CPU for
    multi-megabyte image bodies."""
    task = asyncio.current_task()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire) if timeout_s > 0 and task else None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BodyTooLarge(f"is larger than {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(chunk)
    except asyncio.CancelledError:
        if not expired:
            raise
        if hasattr(task, "uncancel"):  # 3.11+: the cancel was ours, not the caller's
            task.uncancel()
        raise BodyReadTimeout(f"was not received within {timeout_s:g} s (--request_read_timeout)") from None
    finally:
        if timer is not None:
            timer.cancel()
    return b"".join(chunks)


class StreamWriteTimeout(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator however the response ends, so that the generator's
    `finally` (which aborts the request in the engine) runs at once, also when a send failed (a write timeout, a
    dropped connection) with the generator suspended at a `yield`, where it would wait for the garbage
    collector otherwise."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class WriteTimeout:
    """ASGI wrapper: every `send` of an HTTP response must complete within `timeout_s`. uvicorn's send waits while
    the connection's write buffer is over its high-water mark, i.e. while the client does not read; past the
    timeout the connection is dropped (so nothing more is buffered for it) and the app's send raises, which ends
    the response: its stream's `finally` aborts the request."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s
        self.aborted = 0  # responses dropped for a client that stopped reading

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.timeout_s <= 0:
            await self.app(scope, receive, send)
            return

        async def timed_send(message) -> None:
            if message["type"] == "http.response.start":
                _limit_write_buffer(send)
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                _drop_connection(send)
                raise StreamWriteTimeout from None

        try:
            await self.app(scope, receive, timed_send)
        except StreamWriteTimeout:
            self.aborted += 1
            logger.warning("dropped a response to %s: the client read nothing for %g s (--stream_write_timeout)",
                           _client(scope), self.timeout_s)  # fmt: skip


# What may wait for a client that does not read, per connection: in uvicorn's buffer before its send waits
# (asyncio's default is 64 KiB), and unsent in the kernel (TCP_NOTSENT_LOWAT; without it the send buffer grows to
# tcp_wmem's maximum, ~4 MiB, before a write blocks). Data in flight stays bounded by the client's receive window,
# so a client that reads keeps its full speed.
WRITE_BUFFER_HIGH = 16 << 10
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's value where Python does not name it


def _limit_write_buffer(send) -> None:
    transport = _transport(send)
    if transport is None or transport.is_closing():  # the client left: the answer goes nowhere, quietly
        return
    try:
        if hasattr(transport, "set_write_buffer_limits"):
            transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
    except RuntimeError:  # uvloop's transport closed between the check and the call
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, WRITE_BUFFER_HIGH)
        except OSError:  # not Linux / not supported: the send buffer's own limit applies
            pass


def _transport(send):
    """The transport under uvicorn's `send` (a method of its request cycle); None under another ASGI server."""
    return getattr(getattr(send, "__self__", None), "transport", None)


def _drop_connection(send) -> None:
    """Abort the connection under uvicorn's `send` (its request cycle holds the transport), discarding what is
    buffered for the client. Elsewhere (another ASGI server) the raised error alone ends the response."""
    transport = _transport(send)
    if transport is not None and hasattr(transport, "abort"):
        transport.abort()


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"
