"""Greedy tokens of one checkpoint at two --tp degrees (issue 11: a 7B-shaped Qwen2-VL at TP=2 gives TP=1's tokens),
beside how far the first degree agrees with itself.

Starts the server three times in turn, first degree, second degree, first degree again (serve_bench's start, so the
same flags), and sends each the same image requests (img336_x64's first --num_requests, 336 px, greedy, EOS
ignored) to /generate with return_details, ONE AT A TIME: every step then has the same batch shape at both degrees,
so each GPU runs the same GEMM and attention kernels on the same shapes, and what differs is only what tensor
parallelism changes (the order of the fp32 sums in o_proj and down_proj, and the kernels chosen for the narrower
shards). Sent all at once (--concurrent), each step's batch depends on timing, which differs between any two runs.

Prints two JSON lines, "tp1 vs tp1" (the control: the first degree's two runs) and "tp1 vs tpN": identical answers,
the fraction of equal tokens, and for each answer that differs the token where it first does, with the log
probability each run gave its own choice there (two values near each other and near log(1/2) mean a near-tie).
Exits 1 if an answer differs between the degrees.

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

Answer = list[tuple[int, float | None]]  # (token id, its log-probability) per generated token


def answers(url: str, bodies: list[bytes], timeout: float, concurrent: bool) -> list[Answer]:
    def one(body: bytes) -> Answer:
        data = json.loads(body)
        data["parameters"]["return_details"] = True
        r = httpx.post(url + "/generate", json=data, timeout=timeout)
        r.raise_for_status()
        return [(t["id"], t.get("logprob")) for t in r.json()["tokens"]]

    if not concurrent:
        return [one(body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def compare(name: str, a: list[Answer], b: list[Answer]) -> dict:
    """Where two runs' answers to the same requests agree."""
    first, logprobs, same = [], [], 0
    for u, v in zip(a, b, strict=True):
        same += sum(x[0] == y[0] for x, y in zip(u, v, strict=True))
        k = next((k for k, (x, y) in enumerate(zip(u, v, strict=True)) if x[0] != y[0]), None)
        if k is not None:
            first.append(k)
            logprobs.append([None if x is None else round(x, 3) for x in (u[k][1], v[k][1])])
    return {
        "load": "tp_parity", "compare": name, "requests": len(a), "identical_answers": len(a) - len(first),
        "equal_token_fraction": same / sum(map(len, a)), "first_divergence": first,
        "divergence_logprobs": logprobs,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--tp", type=int, nargs=2, default=[1, 2], help="the reference degree (run twice), the other")
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--num_requests", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--concurrent", action="store_true", help="send the requests all at once (batch shapes vary)")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--data_type", default="bf16")
    ap.add_argument("--mem_fraction", type=float, default=0.85)
    ap.add_argument("--server_args", default="", help="more flags for every server")
    ap.add_argument("--startup_timeout", type=float, default=600)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    specs, _ = requests_for(LOADS["img336_x64"], args.family)
    bodies = [s.body(args.max_new_tokens) for s in specs[: args.num_requests]]
    ref, other = args.tp
    base_args = args.server_args
    runs: list[list[Answer]] = []
    for tp in (ref, other, ref):
        args.server_args = f"{base_args} --tp {tp}"
        proc, url, startup = start_server(args)
        try:
            how = "all at once" if args.concurrent else "one at a time"
            log(f"tp={tp}: healthy after {startup:.1f} s; {len(bodies)} requests, {how}")
            runs.append(answers(url, bodies, args.timeout, args.concurrent))
        finally:
            stop_server(proc)
    common = {"model_dir": args.model_dir, "max_new_tokens": args.max_new_tokens, "concurrent": args.concurrent}
    emit(compare(f"tp{ref} vs tp{ref}", runs[0], runs[2]) | common)
    versus = compare(f"tp{ref} vs tp{other}", runs[0], runs[1])
    emit(versus | common)
    sys.exit(0 if not versus["first_divergence"] else 1)


if __name__ == "__main__":
    main()
