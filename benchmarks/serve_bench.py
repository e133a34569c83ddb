"""Serving benchmark (issue 13): the named loads against a running server that speaks LightLLM's `/generate_stream`
(mmserve or LightLLM itself, `--url`), or with `--api openai` OpenAI's `/v1/chat/completions` (vLLM or mmserve), or
against an mmserve server this script starts (`--model_dir`, no `--url`). One JSON line per load on stdout; progress
bars and logs on stderr.

    python benchmarks/serve_bench.py --url http://127.0.0.1:18090 --name lightllm --loads img336_x64,one_336
    python benchmarks/serve_bench.py --model_dir /tmp/q7 --startup --hf --hf_loads img336_x64,img896_x64
    python benchmarks/serve_bench.py --url http://127.0.0.1:18123 --num_requests 4 --repeats 2 --max_new_tokens 8
    python benchmarks/serve_bench.py --url http://127.0.0.1:18091 --api openai --model_name model --loads poisson12_x256
    python benchmarks/serve_bench.py --url http://127.0.0.1:18123 --loads img336_x64,text_x64 --json_schema builtin

Loads (benchmarks/loads.py): img336_x64, img896_x64, img896_same_x64, one_336, one_896, img336_x256, text_x64,
text_one, text_x256, chat896_5turn, and the mixed ones text_mixed_x256, img_mixed_x64 (lengths and image sizes per
request) and poisson12_x256 (Poisson arrivals at 12 req/s). 128 new tokens (a mixed load's own per request), greedy,
`ignore_eos`, streamed (`--json_schema PATH|builtin|builtin_maxlength`: each output constrained to a JSON schema,
benchmarks/json_schema_load.py); token counts from the final event's `token.count_output_tokens`; TTFT is the first
event's arrival; TPOT as benchmarks/bench_stats.py explains. Through the OpenAI API: benchmarks/openai_stream.py.
`--client_procs N` splits each concurrent load over N client processes that start sending at one instant: one
asyncio client spends ~17 ms of CPU pushing each 3.2 MB body (896 px) and cannot read first tokens meanwhile.

chat896_5turn (the prefix-cache issue: turn k's TTFT should stay flat as k grows) is 4 conversations at once
(`--counts chat896_5turn=1` for one alone) of 5 turns each, turn k+1 sent when turn k ended: turn 1 asks about an
896 px image, turn 3 adds a 336 px one, and every turn resends the whole history, the earlier answers being the
server's own streamed text. Its line adds per-turn medians: `ttft_by_turn_ms`, `prompt_tokens_by_turn`,
`finished_by_turn` (and `headers_by_turn_ms` with a `ttft_caveat`).

    python benchmarks/serve_bench.py --url http://127.0.0.1:18777 --loads chat896_5turn --counts chat896_5turn=1"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/serve_bench.py` from anywhere

from benchmarks.bench_client import (  # noqa: E402
    SENDERS,
    log,
    run_concurrent,
    run_concurrent_in_procs,
    run_sequential,
    tqdm,
)
from benchmarks.bench_stats import RequestResult, by_turn, summarize  # noqa: E402
from benchmarks.chat_loads import Conversation, chat_conversations  # noqa: E402
from benchmarks.json_schema_load import load_schema  # noqa: E402
from benchmarks.loads import (  # noqa: E402
    FAMILIES,
    SAMPLING,
    Load,
    RequestSpec,
    arrival_times,
    requests_for,
    select_loads,
    warmup_requests,
)
from benchmarks.openai_stream import served_model  # noqa: E402
from benchmarks.proc_cpu import cpu_delta, session_cpu  # noqa: E402


def encode(spec: RequestSpec, max_new_tokens: int, args: argparse.Namespace) -> bytes:
    """The request's body in the API under test (`args.api`; the OpenAI one names `args.model_name`), its output
    constrained to `args.json_schema` if given, sampled as `args.sampling` says."""
    schema = load_schema(args.json_schema)
    if args.api == "openai":
        return spec.openai_body(max_new_tokens, args.model_name, schema, args.sampling)
    return spec.body(max_new_tokens, schema, args.sampling)


async def run_chats(
    url: str, convs: list[Conversation], desc: str, args: argparse.Namespace
) -> tuple[list[list[RequestResult]], float, float]:
    """The conversations at once, each one's turns in a row (turn k+1 sent when turn k's stream ended, with its
    answer in the history); after a failed turn the conversation stops, its later turns counted as errors. Wall time
    from the first send to the last stream's end."""
    limits = httpx.Limits(max_connections=len(convs) + 8, max_keepalive_connections=len(convs) + 8)
    total = sum(len(c.turns) for c in convs)
    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False) if tqdm else None
    send = SENDERS[args.api]
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def converse(conv: Conversation) -> list[RequestResult]:
            results: list[RequestResult] = []
            answers: list[str] = []
            for k in range(len(conv.turns)):
                r = await send(client, url, encode(conv.request(answers), args.max_new_tokens, args))
                results.append(r)
                if bar is not None:
                    bar.update(1)
                if r.error is not None:
                    skipped = [RequestResult(error=f"not sent: turn {k + 1} failed") for _ in conv.turns[k + 1 :]]
                    if bar is not None:
                        bar.update(len(skipped))
                    return results + skipped
                answers.append(r.text)
            return results

        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(converse(c) for c in convs))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if bar is not None:
        bar.close()
    return list(results), wall, cpu


def run_chat_load(url: str, load: Load, family: str, args: argparse.Namespace) -> dict:
    convs = chat_conversations(load, family, args.question_words)
    per_conv, wall, cpu = asyncio.run(run_chats(url, convs, load.name, args))
    results = [r for conv in per_conv for r in conv]
    summary = summarize(results, wall)
    summary["client_cpu_s"] = round(cpu, 2)
    summary.update(conversations=len(convs), turns=load.turns)
    summary.update(by_turn(per_conv, with_headers="ttft_caveat" in summary))
    summary.update(short_requests(results, [args.max_new_tokens] * len(results)))
    return summary


def short_requests(results: list[RequestResult], wanted: list[int]) -> dict:
    """A caveat when a finished request got fewer tokens than it asked for (EOS is ignored, so none should)."""
    short = [(r.tokens, n) for r, n in zip(results, wanted, strict=True) if r.error is None and r.tokens < n]
    if not short:
        return {}
    got, asked = short[0]
    return {"short_requests_caveat": f"{len(short)} request(s) got fewer tokens than asked, e.g. {got} < {asked}"}


def run_load(url: str, load: Load, family: str, args: argparse.Namespace) -> dict:
    if load.is_chat:
        return run_chat_load(url, load, family, args)
    specs, warm = requests_for(load, family, args.question_words, args.image_round)
    bodies = [encode(s, args.max_new_tokens, args) for s in specs]
    if warm is not None:  # the image is seen once before: the timed requests hit the embedding cache
        warm_body = encode(warm, args.max_new_tokens, args)
        res, _, _ = asyncio.run(run_sequential(url, [warm_body], "cache warm", args.timeout, args.api))
        if res[0].error:
            log(f"{load.name}: the cache-warming request failed: {res[0].error}")
    send_at = arrival_times(load)
    if load.sequential:
        results, wall, cpu = asyncio.run(run_sequential(url, bodies, load.name, args.timeout, args.api))
    elif args.client_procs > 1:
        results, wall, cpu = run_concurrent_in_procs(
            url, bodies, load.name, args.timeout, args.client_procs, args.api, send_at
        )
    else:
        results, wall, cpu = asyncio.run(
            run_concurrent(url, bodies, load.name, args.timeout, api=args.api, send_at=send_at)
        )
    summary = summarize(results, wall, sequential=load.sequential)
    summary["client_cpu_s"] = round(cpu, 2)  # while sending and reading: near wall_s, the client bounds the load
    if args.client_procs > 1 and not load.sequential:
        summary["client_procs"] = args.client_procs
    if send_at is not None:  # the offered load: req_per_s cannot pass it
        summary.update(arrival_rate_per_s=load.rate, arrivals_span_s=send_at[-1])
    wanted = [s.new_tokens(args.max_new_tokens) for s in specs]
    if load.new_token_range is not None:
        summary["new_tokens_asked"] = sum(wanted)
    summary.update(short_requests(results, wanted))
    return summary


def measured(runner, url: str, load: Load, args: argparse.Namespace, session: int | None) -> dict:
    """runner's summary plus the CPU seconds (with a session id) each server process spent on the load: one near
    the wall time is saturated and bounds the load."""
    before = session_cpu(session) if session else None
    summary = runner(url, load, args.family, args)
    if before is not None:
        summary["server_cpu_s"] = cpu_delta(before, session_cpu(session))
    return summary


def warm_up(url: str, loads: list[Load], family: str, args: argparse.Namespace) -> None:
    specs: list[RequestSpec] = warmup_requests(loads, family, args.question_words)
    t0 = time.perf_counter()
    bodies = [encode(s, 16, args) for s in specs]
    results, _, _ = asyncio.run(run_concurrent(url, bodies, "warm-up", args.timeout, api=args.api))
    errors = [r.error for r in results if r.error]
    log(
        f"warm-up: {len(specs)} requests in {time.perf_counter() - t0:.1f} s"
        + (f", errors: {errors}" if errors else "")
    )
    if len(errors) == len(results):
        raise SystemExit(f"every warm-up request failed, e.g. {errors[0]}")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    """Start mmserve as a user would (issue 13's flags); returns (process, url, seconds from start to /health OK)."""
    cmd = [sys.executable, "-m", "mmserve.api_server", "--host", "127.0.0.1", "--port", str(args.port)]
    if args.model_dir:
        cmd += ["--model_dir", args.model_dir]
    cmd += ["--enable_multimodal", "--cache_capacity", "256", "--data_type", args.data_type]
    cmd += ["--mem_fraction", str(args.mem_fraction), *args.server_args.split()]
    url = f"http://127.0.0.1:{args.port}"
    log("starting: " + " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    while time.perf_counter() - t0 < args.startup_timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise SystemExit("server did not become healthy")


def kv_tokens(url: str) -> int | None:
    """The server's KV cache size in token slots (its /metrics gauge), or None where it reports none."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("mmserve_kv_tokens_total "):
            return int(float(line.split()[1]))
    return None


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def emit(line: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}), flush=True)


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of the server started here: what start_server reads besides --family and --model_dir, and --startup
    (report its start-to-healthy time)."""
    ap.add_argument("--startup", action="store_true", help="report start-to-healthy of the server started here")
    ap.add_argument("--startup_timeout", type=float, default=600)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--data_type", default="bf16")
    ap.add_argument("--mem_fraction", type=float, default=0.85)
    ap.add_argument("--server_args", default="", help="more flags for the server started here")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; omitted: start mmserve here")
    ap.add_argument(
        "--server_session",
        type=int,
        default=None,
        help="session id of a running server's processes (its launcher's pid if started with setsid), "
        "to report their CPU seconds per load; the server started here is measured anyway",
    )
    ap.add_argument("--name", default=None, help='"server" in the JSON lines (default: mmserve)')
    ap.add_argument(
        "--api",
        choices=tuple(SENDERS),
        default="lightllm",
        help="lightllm: /generate_stream; openai: /v1/chat/completions, streamed with usage (vLLM, mmserve)",
    )
    ap.add_argument(
        "--model_name", default=None, help='--api openai: the "model" to send (default: the first /v1/models lists)'
    )
    ap.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    ap.add_argument("--model_dir", default=None, help="checkpoint for the server started here, and for --hf")
    ap.add_argument("--loads", default="all", help="comma-separated load names, or all")
    ap.add_argument("--num_requests", type=int, default=None, help="override every concurrent load's count")
    ap.add_argument("--repeats", type=int, default=None, help="override the sequential loads' repeats (5)")
    ap.add_argument("--counts", default=None, help='per-load counts, "img336_x256=128,one_336=3"')
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--question_words", type=int, default=64, help="words in each question")
    ap.add_argument("--no_warmup", action="store_true")
    ap.add_argument(
        "--json_schema",
        default=None,
        help="PATH of a JSON schema, builtin or builtin_maxlength (benchmarks/json_schema_load.py): every request's "
        "output follows it (guided_json)",
    )
    ap.add_argument(
        "--sampling",
        choices=sorted(SAMPLING),
        default="greedy",
        help="how every request samples: greedy, or top_p (temperature 0.7, top-p 0.9, no top-k)",
    )
    ap.add_argument(
        "--image_round",
        type=int,
        default=0,
        help="new random images (round N's seeds): repeats of a load against one running server miss its cache",
    )
    ap.add_argument("--timeout", type=float, default=600, help="per request, s")
    add_server_flags(ap)
    ap.add_argument(
        "--client_procs",
        type=int,
        default=1,
        help="client processes the concurrent image and text loads are split over (1: one asyncio client)",
    )
    ap.add_argument("--hf", action="store_true", help="then HF transformers generate on the same work")
    ap.add_argument("--hf_loads", default="img336_x64,img896_x64", help="loads for --hf (all: every one)")
    ap.add_argument("--hf_batch", type=int, default=64)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loads = select_loads(args.loads, args.num_requests, args.repeats, args.counts)
    name = args.name or "mmserve"
    common = {"server": name, "family": args.family, "max_new_tokens": args.max_new_tokens, "api": args.api}
    if args.json_schema is not None:
        common["json_schema"] = args.json_schema
    proc = None
    url = args.url.rstrip("/") if args.url else None
    if loads and url is None:
        proc, url, startup = start_server(args)
        if args.startup:
            emit({**common, "load": "start_to_healthy", "startup_s": startup, "kv_tokens": kv_tokens(url)})
    try:
        if loads and args.api == "openai" and args.model_name is None:
            args.model_name = served_model(url)
        if loads and not args.no_warmup:
            warm_up(url, loads, args.family, args)
        session = proc.pid if proc is not None else args.server_session
        for load in loads:
            emit({**common, "load": load.name, **measured(run_load, url, load, args, session)})
    finally:
        if proc is not None:
            stop_server(proc)
    if args.hf:
        if not args.model_dir:
            raise SystemExit("--hf needs --model_dir")
        from benchmarks.hf_baseline import run_hf_loads

        hf_loads = select_loads(args.hf_loads, args.num_requests, args.repeats, args.counts)
        for line in run_hf_loads(
            args.family, args.model_dir, hf_loads, args.max_new_tokens, args.hf_batch, args.question_words
        ):
            emit({**common, "server": "hf", **line})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
