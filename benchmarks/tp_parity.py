"""Greedy tokens of one checkpoint at two --tp degrees (issue 11: a 7B-shaped Qwen2-VL at TP=2 gives TP=1's tokens).

Starts the server at each degree in turn (serve_bench's start, so the same flags), sends the same image requests
(img336_x64's first --num_requests, 336 px, greedy, EOS ignored) to /generate with return_details, and prints one
JSON line: how many answers are identical, and for the others where they first differ. The ranks sum partial
products in another order than one GPU does, so bf16 logits differ in their last bits; a near-tie may then flip late
in an answer, which the line shows rather than hides.

    python benchmarks/tp_parity.py --model_dir /tmp/q2vl7b --tp 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/tp_parity.py` from anywhere
from benchmarks.loads import LOADS, requests_for  # noqa: E402
from benchmarks.serve_bench import emit, log, start_server, stop_server  # noqa: E402


def answers(url: str, bodies: list[bytes], timeout: float) -> list[list[int]]:
    def one(body: bytes) -> list[int]:
        data = json.loads(body)
        data["parameters"]["return_details"] = True
        r = httpx.post(url + "/generate", json=data, timeout=timeout)
        r.raise_for_status()
        return [t["id"] for t in r.json()["tokens"]]

    with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: the batch a load runs, not one request at a time
        return list(pool.map(one, bodies))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--tp", type=int, nargs=2, default=[1, 2])
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--num_requests", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--data_type", default="bf16")
    ap.add_argument("--mem_fraction", type=float, default=0.85)
    ap.add_argument("--server_args", default="", help="more flags for both servers")
    ap.add_argument("--startup_timeout", type=float, default=600)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    specs, _ = requests_for(LOADS["img336_x64"], args.family)
    bodies = [s.body(args.max_new_tokens) for s in specs[: args.num_requests]]
    results = {}
    base_args = args.server_args
    for tp in args.tp:
        args.server_args = f"{base_args} --tp {tp}"
        proc, url, startup = start_server(args)
        try:
            log(f"tp={tp}: healthy after {startup:.1f} s; {len(bodies)} requests")
            results[tp] = answers(url, bodies, args.timeout)
        finally:
            stop_server(proc)
    a, b = (results[tp] for tp in args.tp)
    pairs = list(zip(a, b, strict=True))
    diverge = [next((k for k, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), None) for u, v in pairs]
    same_tokens = sum(x == y for u, v in pairs for x, y in zip(u, v, strict=True))
    emit({
        "load": "tp_parity", "model_dir": args.model_dir, "tp": args.tp, "requests": len(bodies),
        "identical_answers": sum(d is None for d in diverge), "equal_token_fraction": same_tokens / sum(map(len, a)),
        "first_divergence": [d for d in diverge if d is not None],
    })  # fmt: skip
    sys.exit(0 if all(d is None for d in diverge) else 1)


if __name__ == "__main__":
    main()
