"""The client side of the serving benchmark: one streamed request over LightLLM's `/generate_stream` (LightLLM,
mmserve) or, through benchmarks/openai_stream.py, OpenAI's `/v1/chat/completions` (vLLM, mmserve), and the ways to
send a load's requests: all at once, at given times (Poisson arrivals), split over client processes, or one after
another. Every sender gives `RequestResult`s (benchmarks/bench_stats.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import httpx

from benchmarks.bench_stats import RequestResult
from benchmarks.openai_stream import one_openai_request
from benchmarks.sse_stream import stream_request

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    tqdm = None


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


def event_count(event: dict) -> int | None:
    """Cumulative output tokens of a stream event (under "token", in both servers' events)."""
    token = event.get("token")
    return token.get("count_output_tokens") if isinstance(token, dict) else None


def event_text(event: dict) -> str:
    """The event's new text piece (`token.text` in both servers' events)."""
    token = event.get("token")
    text = token.get("text") if isinstance(token, dict) else None
    return text if isinstance(text, str) else ""


def event_prompt_tokens(event: dict) -> int | None:
    token = event.get("token")
    return token.get("prompt_tokens") if isinstance(token, dict) else None


def read_generate_event(r: RequestResult, event: dict, now: float) -> None:
    """Fold one /generate_stream event into `r`; its final event ("finished") carries the token total."""
    r.events.append((now, event_count(event)))
    r.text += event_text(event)
    if r.prompt_tokens is None:
        r.prompt_tokens = event_prompt_tokens(event)
    if event.get("finished"):
        r.tokens = event_count(event) or 0


async def one_request(client: httpx.AsyncClient, url: str, body: bytes) -> RequestResult:
    r = await stream_request(client, url + "/generate_stream", body, read_generate_event)
    if r.error is None and not r.tokens:
        r.error = "stream ended without a finished event"
    return r


# The request sender of each API: LightLLM's /generate_stream (LightLLM, mmserve) or OpenAI's chat (vLLM, mmserve).
SENDERS = {"lightllm": one_request, "openai": one_openai_request}


async def run_concurrent(
    url: str,
    bodies: list[bytes],
    desc: str,
    timeout: float,
    progress: bool = True,
    api: str = "lightllm",
    send_at: list[float] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """All requests at once, or request i at `send_at[i]` s after the start (Poisson arrivals); (results, wall time
    from the first send to the last stream's end, this client's CPU seconds meanwhile)."""
    send = SENDERS[api]
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    bar = tqdm(total=len(bodies), desc=desc, file=sys.stderr, leave=False) if tqdm and progress else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def tracked(body: bytes, at: float) -> RequestResult:
            if at > 0:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            res = await send(client, url, body)
            if bar is not None:
                bar.update(1)
            return res

        times = send_at or [0.0] * len(bodies)
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(tracked(b, at) for b, at in zip(bodies, times, strict=True)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if bar is not None:
        bar.close()
    return list(results), wall, cpu


def run_concurrent_in_procs(
    url: str,
    bodies: list[bytes],
    desc: str,
    timeout: float,
    procs: int,
    api: str = "lightllm",
    send_at: list[float] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """run_concurrent split over `procs` client processes that start sending at one agreed instant (each request at
    its `send_at` from there), so that the client's own CPU (httpx pushing multi-MB bodies, ~17 ms each, while it
    cannot read the first tokens) does not bound the load: (results in the bodies' order, wall time from that instant
    to the last stream's end, the CPU seconds of all the client processes)."""
    shares = [bodies[i::procs] for i in range(procs)]  # round robin: each process gets a mix
    times = [(send_at or [0.0] * len(bodies))[i::procs] for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=procs, mp_context=ctx) as pool:
        while len(set(pool.map(_client_ready, range(procs)))) < procs:  # until every process has started
            pass
        start_at = time.time() + 0.2
        n = len(shares)
        parts = list(pool.map(_client_share, [url] * n, shares, [timeout] * n, [start_at] * n, [api] * n, times))
    results: list[RequestResult] = [RequestResult()] * len(bodies)
    for i, (share_results, _, _) in enumerate(parts):
        results[i::procs] = share_results
    wall = max(end for _, end, _ in parts) - start_at
    log(f"{desc}: {len(bodies)} requests from {procs} client processes in {wall:.2f} s")
    return results, wall, sum(cpu for _, _, cpu in parts)


def _client_ready(_: int) -> int:
    time.sleep(0.1)  # held a moment, so that each process of the pool takes one of these
    return os.getpid()


def _client_share(
    url: str, bodies: list[bytes], timeout: float, start_at: float, api: str, send_at: list[float]
) -> tuple[list, float, float]:
    """In a client process: wait for the agreed instant, send its share (at once, or each at its time from that
    instant); (results, end time, CPU s)."""
    time.sleep(max(0.0, start_at - time.time()))
    results, wall, cpu = asyncio.run(run_concurrent(url, bodies, "", timeout, False, api, send_at))
    return results, start_at + wall, cpu


async def run_sequential(
    url: str, bodies: list[bytes], desc: str, timeout: float, api: str = "lightllm"
) -> tuple[list[RequestResult], float, float]:
    send = SENDERS[api]
    results, wall, cpu0 = [], 0.0, time.process_time()
    async with httpx.AsyncClient(timeout=timeout) as client:
        for body in tqdm(bodies, desc=desc, file=sys.stderr, leave=False) if tqdm else bodies:
            t0 = time.perf_counter()
            results.append(await send(client, url, body))
            wall += time.perf_counter() - t0
    return results, wall, time.process_time() - cpu0
