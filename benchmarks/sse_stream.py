"""One timed, streamed POST read as server-sent events: the transport both benchmark clients share (LightLLM's
`/generate_stream` in benchmarks/bench_client.py, OpenAI's chat in benchmarks/openai_stream.py). Each API folds its
own events into the `RequestResult`; the HTTP status, error events, `[DONE]` and the timings are handled here once."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx

from benchmarks.bench_stats import RequestResult

# Folds one parsed event, `now` seconds after sending, into the request's result.
EventReader = Callable[[RequestResult, dict, float], None]


async def stream_request(client: httpx.AsyncClient, url: str, body: bytes, read_event: EventReader) -> RequestResult:
    """POST `body` to `url` and hand each `data:` event to `read_event` until the stream ends, sends `[DONE]` or an
    event with an "error"; a non-200 status, an error event or a broken stream becomes `error`."""
    r = RequestResult()
    t0 = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json"}
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            r.headers = time.perf_counter() - t0
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    r.error = str(event["error"])
                    break
                read_event(r, event, time.perf_counter() - t0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.latency = time.perf_counter() - t0
    return r
