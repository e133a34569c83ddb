"""Bounded soak (issue 10): thousands of concurrent streaming clients against one server on CPU, with a tiny random
LLaVA-1.5 (images from a pool, so the embedding cache both hits and evicts) or a tiny Llama (`--text`). Every client
opens its stream at once and waits in the server's queue; each checks its streamed pieces against the final event's
`generated_text` (a lost or duplicated token shows as a mismatch) and its token count against `max_new_tokens`.

    python benchmarks/soak.py                      # 2000 clients x 1 request, at most 10 minutes
    python benchmarks/soak.py --clients 500 --requests_per_client 3 --text

Prints one JSON line: requests, failures (by kind), mismatches, latency percentiles, throughput, the peak RSS of
each server process (sampled every 0.5 s from /proc), and the /dev/shm entries of the server left after its stop.
docs/reliability.md records the figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/soak.py` from anywhere

from mmserve.testing.checkpoints.llama import build_llama  # noqa: E402
from mmserve.testing.checkpoints.llava import build_llava_hf  # noqa: E402
from mmserve.testing.images import picture, png_b64  # noqa: E402
from mmserve.testing.server_proc import ServerProcess, child_pids  # noqa: E402

PROMPT = "USER: <image>\nDescribe the picture. ASSISTANT:"


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


async def sample_rss(pids: dict[str, int], peaks: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            peaks[name] = max(peaks.get(name, 0.0), rss_mib(pid))
        await asyncio.sleep(0.5)


async def one_request(client: httpx.AsyncClient, url: str, body: dict, max_new: int) -> tuple[str, float]:
    """('ok' | a failure kind, latency in s)."""
    start = time.monotonic()
    pieces, last = [], None
    try:
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}", time.monotonic() - start
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    last = json.loads(line[5:])
                    pieces.append(last["token"]["text"] if "token" in last else "")
    except httpx.HTTPError as e:
        return f"transport_{type(e).__name__}", time.monotonic() - start
    latency = time.monotonic() - start
    if last is None or not last.get("finished") or last.get("finish_reason") != "length":
        return "not_finished", latency
    if last["token"].get("count_output_tokens") != max_new:
        return "token_count", latency
    if "".join(pieces) != last.get("generated_text"):
        return "text_mismatch", latency
    return "ok", latency


async def run_clients(args, url: str, pids: dict[str, int]) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    timeout = httpx.Timeout(args.max_minutes * 60, connect=60)
    images = [png_b64(picture(48, 40, seed)) for seed in range(args.image_pool)] if not args.text else []
    deadline = time.monotonic() + args.max_minutes * 60
    outcomes: list[tuple[str, float]] = []
    peaks: dict[str, float] = {}
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        for k in range(args.requests_per_client):
            if time.monotonic() > deadline:
                return
            params = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}
            if args.text:
                body = {"inputs": f"Client {i} asks question {k}:", "parameters": params}
            else:
                image = images[(i * args.requests_per_client + k) % len(images)]
                body = {"inputs": PROMPT, "parameters": params,
                        "multimodal_params": {"images": [{"type": "base64", "data": image}]}}  # fmt: skip
            outcomes.append(await one_request(client, url, body, args.max_new_tokens))

    async def progress() -> None:
        while not stop.is_set():
            await asyncio.sleep(10)
            print(f"soak: {len(outcomes)} requests done", file=sys.stderr, flush=True)

    sampler = asyncio.create_task(sample_rss(pids, peaks, stop))
    reporter = asyncio.create_task(progress())
    start = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(args.clients)))
    elapsed = time.monotonic() - start
    stop.set()
    await asyncio.gather(sampler, reporter)
    latencies = sorted(lat for kind, lat in outcomes if kind == "ok")
    failures: dict[str, int] = {}
    for kind, _ in outcomes:
        if kind != "ok":
            failures[kind] = failures.get(kind, 0) + 1

    def pct(p: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2) if latencies else None

    return {
        "requests": len(outcomes),
        "ok": len(latencies),
        "failures": failures,
        "wall_s": round(elapsed, 1),
        "requests_per_s": round(len(outcomes) / elapsed, 2),
        "tokens_per_s": round(len(latencies) * args.max_new_tokens / elapsed, 1),
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": latencies[-1] if latencies else None},
        "peak_rss_mib": {name: round(v, 1) for name, v in peaks.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--requests_per_client", type=int, default=1)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--max_minutes", type=float, default=10.0, help="clients stop starting requests after this")
    ap.add_argument("--image_pool", type=int, default=100, help="distinct images (the cache holds 200)")
    ap.add_argument("--text", action="store_true", help="text only, on a tiny Llama")
    ap.add_argument("--max_total_token_num", type=int, default=16384)
    args = ap.parse_args()
    fd_limit = raise_fd_limit()
    work = tempfile.mkdtemp(prefix="mmserve-soak-")
    model = build_llama(f"{work}/llama") if args.text else build_llava_hf(f"{work}/llava")
    extra = [] if args.text else ["--enable_multimodal"]
    srv = ServerProcess(model, f"{work}/server.log", "--max_total_token_num", str(args.max_total_token_num), *extra)
    srv.wait_healthy()
    pids = {"http": srv.proc.pid} | {comm(p).removeprefix("mmserve-"): p for p in child_pids(srv.proc.pid)}
    result = asyncio.run(run_clients(args, srv.url, pids))
    metrics = srv.metrics()
    code = srv.stop()
    shm_left = [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{srv.proc.pid}_")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result.update(
        clients=args.clients,
        requests_per_client=args.requests_per_client,
        max_new_tokens=args.max_new_tokens,
        model="tiny Llama (text)" if args.text else "tiny LLaVA-1.5 (one image per request)",
        server_exit_code=code,
        kv_tokens_used_at_end=metrics.get("mmserve_kv_tokens_used"),
        shm_entries_left=len(shm_left),
        fd_limit=fd_limit,
        commit=commit.stdout.strip(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        server_log_errors=sum("ERROR" in line or "Traceback" in line for line in open(srv.log_path)),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
