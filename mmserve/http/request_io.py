"""Request plumbing that the /generate routes and the OpenAI routes share: reading a body within the read timeout,
noticing that the client left, gathering each sequence's whole output, the debug log's per-request timing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request

from mmserve.http.engine_client import ClientDisconnected, EngineClient, RequestStream, ServerFailure
from mmserve.http.protocol import BadRequest
from mmserve.http.slow_clients import BodyReadTimeout, BodyTooLarge, read_body
from mmserve.ipc.messages import TextOutput, TokenDetail

logger = logging.getLogger(__name__)


async def read_request_body(request: Request) -> bytes:
    """The body, within --request_read_timeout; too large or too slow: a 413 / 408 naming it."""
    try:
        return await read_body(request, request.app.state.client_timeouts.read_s)
    except BodyTooLarge as e:
        raise BadRequest("body", str(e), status=413) from None
    except BodyReadTimeout as e:
        raise BadRequest("body", str(e), status=408) from None


def log_request_timing(rid: str, nbytes: int, start: float, read: float, parsed: float) -> None:
    """At debug level, a request's stages from arrival to the router (perf_counter times: the handler's start, the
    body read, the body parsed into engine inputs; now: submitted), the `request timing` line that
    benchmarks/ttft_stages.py reads beside the router's. Cheap when debug is off."""
    if logger.isEnabledFor(logging.DEBUG):
        now = time.perf_counter()
        logger.debug("request timing: rid=%s bytes=%d read_ms=%.1f parse_ms=%.1f prepare_ms=%.1f total_ms=%.1f "
                     "start=%.4f", rid, nbytes, (read - start) * 1e3, (parsed - read) * 1e3, (now - parsed) * 1e3,
                     (now - start) * 1e3, start)  # fmt: skip


def check_json_content_type(request: Request) -> None:
    """The OpenAI routes read JSON bodies only: a body sent as another media type (a form, as `curl -d` sends
    without -H) is refused with 400, as vLLM refuses it; a request with no Content-Type is read as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise BadRequest("body", f"Content-Type {media or '(empty)'!r} is not supported: send application/json")


def most_likely(results: list[tuple[TextOutput, str, list[TokenDetail]]], n: int) -> list:
    """best_of: the n sequences of `results` with the highest cumulative log-probability, in their order."""
    if len(results) <= n:
        return results
    ranked = sorted(range(len(results)), key=lambda i: -sum(t.logprob for t in results[i][2]))
    return [results[i] for i in sorted(ranked[:n])]


def watch_disconnect(request: Request) -> asyncio.Future:
    """Done when the client closes the connection (the body has been read, so the next ASGI message is the
    disconnect)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(wait())


async def collect_stream(
    stream: RequestStream, disconnected: asyncio.Future
) -> tuple[TextOutput, str, list[TokenDetail]]:
    """All of one sequence: (its last output, carrying the prompt's scores if the first one had them, the whole
    text, every token)."""
    text: list[str] = []
    tokens: list[TokenDetail] = []
    scores = None
    while True:
        out = await stream.next(disconnected)
        if out.error is not None:
            return out, "", []
        text.append(out.text)
        tokens.extend(out.tokens)
        scores = scores or out.prompt_logprobs
        if out.finished:
            return replace(out, prompt_logprobs=scores), "".join(text), tokens


async def collect_streams(
    client: EngineClient, streams: list[RequestStream], disconnected: asyncio.Future
) -> list[tuple[TextOutput, str, list[TokenDetail]]]:
    """collect_stream of every sequence of one request, together; raises ServerFailure or ClientDisconnected. Either
    way, the sequences that have not finished are aborted and the disconnect watch is stopped."""
    tasks = [asyncio.ensure_future(collect_stream(stream, disconnected)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        disconnected.cancel()
        for task in tasks:
            task.cancel()
        for stream in streams:
            if not stream.finished:
                client.abort(stream.rid)


async def merge_streams(streams: list[RequestStream], firsts: list[TextOutput], disconnected) -> AsyncIterator[tuple]:
    """(choice index, output) of every stream as they arrive, until each has finished; a stream's ServerFailure or
    ClientDisconnected is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream, out: TextOutput) -> None:
        try:
            while True:
                queue.put_nowait((index, out))
                if out.finished:
                    return
                out = await stream.next(disconnected)
        except (ServerFailure, ClientDisconnected) as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts, strict=True))]
    try:
        left = len(streams)
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                left -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
