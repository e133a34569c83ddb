"""Greedy tokens of one checkpoint at two --tp degrees, judged by vLLM's logprob rule (check_logprobs_close): where
two answers first differ, each side's token must be among the other side's 5 most likely there. Bit-equal answers
across degrees are not expected in bf16: tensor parallelism changes the order of the fp32 sums in o_proj and
down_proj and the kernels chosen for the narrower shards, and random weights have near-tied logits.

Starts the server three times in turn, first degree, second degree, first degree again (serve_bench's start, so the
same flags), and sends each the same image questions (img336_x64's first --num_requests: a 336 px image and a
64-word question, greedy, EOS ignored) through /v1/chat/completions with `top_logprobs: 5`, ONE AT A TIME: every
step then has the same batch shape at both degrees, so what differs is only what tensor parallelism changes.

Prints two JSON lines, "tp1 vs tp1" (the control: the first degree's two runs) and "tp1 vs tpN": identical answers,
the fraction of equal tokens, and for each answer that differs the token where it first does, whether the rule holds
there, and its gap: how much less likely each side found the other's token than its own (the larger of the two, in
nats; a near-tie is close to 0). Tokens are compared by their text (the chat route's logprobs name tokens by text).
Exits 1 if the rule fails on any answer between the degrees.

    python benchmarks/tp_parity.py --model_dir /tmp/q2vl7b --tp 1 2
"""

from __future__ import annotations

import argparse
import base64
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/tp_parity.py` from anywhere
from benchmarks.loads import LOADS, question, requests_for  # noqa: E402
from benchmarks.serve_bench import emit, log, start_server, stop_server  # noqa: E402

TOP = 5  # vLLM's check_logprobs_close looks this far down each side's list


@dataclass(frozen=True)
class Position:
    token: str
    logprob: float
    top: dict[str, float]  # the TOP most likely tokens here -> their log-probabilities


Answer = list[Position]


def chat_body(png: bytes, text: str, max_new_tokens: int) -> dict:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    return {
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": text}]}],
        "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP,
    }  # fmt: skip


def answers(url: str, bodies: list[dict], timeout: float, concurrent: bool) -> list[Answer]:
    def one(body: dict) -> Answer:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        r.raise_for_status()
        content = r.json()["choices"][0]["logprobs"]["content"]
        return [
            Position(c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]}) for c in content
        ]

    if not concurrent:
        return [one(body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def divergence(u: Position, v: Position) -> tuple[bool, float | None]:
    """(the rule holds here, the gap): each token in the other's top list; the gap is how much less likely each side
    found the other's token than its own, the larger of the two (None where a token is outside the other's list)."""
    holds = u.token in v.top and v.token in u.top
    if not holds:
        return False, None
    return True, max(u.logprob - u.top[v.token], v.logprob - v.top[u.token])


def compare(name: str, a: list[Answer], b: list[Answer]) -> dict:
    """Where two runs' answers to the same requests agree, and whether they differ only where vLLM's rule allows."""
    first, gaps, failures, same = [], [], 0, 0
    for u, v in zip(a, b, strict=True):
        same += sum(x.token == y.token for x, y in zip(u, v, strict=True))
        k = next((k for k, (x, y) in enumerate(zip(u, v, strict=True)) if x.token != y.token), None)
        if k is not None:
            holds, gap = divergence(u[k], v[k])
            first.append(k)
            gaps.append(None if gap is None else round(gap, 4))
            failures += not holds
    known = [g for g in gaps if g is not None]
    return {
        "load": "tp_parity", "compare": name, "requests": len(a), "identical_answers": len(a) - len(first),
        "equal_token_fraction": same / sum(map(len, a)), "first_divergence": first, "divergence_gaps": gaps,
        "logprob_rule_holds": len(a) - failures, "worst_gap": max(known) if known else None,
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
    bodies = [
        chat_body(s.image_png, question(i), args.max_new_tokens) for i, s in enumerate(specs[: args.num_requests])
    ]
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
    sys.exit(0 if versus["logprob_rule_holds"] == versus["requests"] else 1)


if __name__ == "__main__":
    main()
