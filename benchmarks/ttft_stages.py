"""Where a burst's time to first token goes, stage by stage, from a server's `--log_level debug` log.

    python benchmarks/ttft_stages.py SERVER_LOG [--min_requests 16]

The HTTP side's `request timing` and `image request timing` lines and the router's `router timing` line of one
request share its rid; requests whose HTTP starts lie within a second of each other form a burst (a load run against
the server). Per burst of at least --min_requests requests, the median, 10th and 90th percentile of each stage:

- start: the HTTP handler's start, after the burst's first (the intake's spread: the client's upload and the
  server's event loop)
- read+parse: the body's read and its JSON parse
- image+prompt: the images' decode, check and hash, and the prompt's expansion and tokenization
- encode wait: from the encode jobs' submission to the embeddings being in the cache (preprocessing, the queue for
  the tower, the tower batch, the shared-memory write)
- router: from the request's arrival in the router to its first token leaving it (the wait for a step, and the
  prefill)
- first token: from the burst's first start to the request's first token leaving the router

and, over the burst's window, the router's host time per prompt step (from the previous step's read-back to the
launch returning), which the device waits through. Then the burst's phases, on the same clock from its first start:
when the first tower batch began and the first step's launch returned (what ran before: the intake); the prompt
phase, until the last step with prompt tokens was read back (its steps and tokens); the decode tail after it, until
the burst's last step (its steps and their median spacing, launch to launch); and the tower's batches (images, and
the sum of their tower times). A load's floor is these phases at the device's rates.

    python benchmarks/ttft_stages.py SERVER_LOG --single

One request at a time instead (the sequential loads one_336, one_896), each with its image's way through the visual
process (the `tower batch` line whose first image arrived during the request), in order: read+parse; load+hash (the
image's header and cache key); to visual (the encode job's hop to the visual process); decode and preprocess (in a
pool worker); pool hand-off (the rest of the wait for the tower: the pool's queue, the pixels' segment, the wake-up);
tower (upload, tower and projector, back to host memory); write (into the shared-memory cache); back to router
(EncodeDone to the HTTP process, which then sends the request to the router); router (the prefill and the first
token's way out of the router); and server total, from the HTTP handler's start. The medians over the requests, then
each request's line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/ttft_stages.py` from anywhere

from benchmarks.log_timeline import debug_fields  # noqa: E402

STAGES = ("start", "read+parse", "image+prompt", "encode wait", "router", "first token")
SINGLE_STAGES = ("read+parse", "load+hash", "to visual", "decode", "preprocess", "pool hand-off", "tower", "write",
                 "back to router", "router", "server total")  # fmt: skip


def requests_and_steps(lines) -> tuple[dict[str, dict[str, float]], list[tuple[float, float, int]]]:
    """Per rid: the stages' raw figures (s); and the steps as (launched, collected, prompt tokens)."""
    reqs: dict[str, dict[str, float]] = defaultdict(dict)
    steps = []
    for line in lines:
        f = debug_fields(line)
        if f is None:
            continue
        if "image request timing:" in line:
            r = reqs[f["rid"]]
            r["image+prompt"] = (float(f["load_hash_ms"]) + float(f["prompt_ms"])) / 1e3
            r["load+hash"] = float(f["load_hash_ms"]) / 1e3
            r["encode wait"] = float(f["encode_wait_ms"]) / 1e3
        elif "request timing:" in line and "start" in f:
            r = reqs[f["rid"]]
            r["http_start"] = float(f["start"])
            r["read+parse"] = (float(f["read_ms"]) + float(f["parse_ms"])) / 1e3
        elif "router timing:" in line:
            r = reqs[f["rid"]]
            r["router"] = float(f["first_token_ms"]) / 1e3
            r["router_arrived"] = float(f["arrived"])
            r["first_token_at"] = float(f["arrived"]) + r["router"]
        elif "step timing:" in line:
            steps.append((float(f["launched"]), float(f["collected"]), int(f["prefill_tokens"])))
    complete = {rid: r for rid, r in reqs.items() if {"http_start", "first_token_at"} <= r.keys()}
    return complete, sorted(steps)


def bursts(reqs: dict[str, dict[str, float]], gap_s: float = 1.0) -> list[list[dict[str, float]]]:
    """Requests grouped by HTTP start: a new burst begins after a gap of more than gap_s."""
    out: list[list[dict[str, float]]] = []
    for r in sorted(reqs.values(), key=lambda r: r["http_start"]):
        if not out or r["http_start"] - out[-1][-1]["http_start"] > gap_s:
            out.append([])
        out[-1].append(r)
    return out


def burst_stages(burst: list[dict[str, float]]) -> dict[str, list[float]]:
    """Each stage's figures (s) over the burst's requests (a stage a request did not go through is left out)."""
    t0 = burst[0]["http_start"]
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    for r in burst:
        stages["start"].append(r["http_start"] - t0)
        stages["first token"].append(r["first_token_at"] - t0)
        for name in ("read+parse", "image+prompt", "encode wait", "router"):
            if name in r:
                stages[name].append(r[name])
    return stages


def prompt_step_host_gaps(steps: list[tuple[float, float, int]], since: float, until: float) -> list[float]:
    """Per prompt step launched in [since, until]: seconds from the previous step's read-back to its launch."""
    gaps = []
    for (_, prev_collected, _), (launched, _, tokens) in zip(steps, steps[1:], strict=False):
        if tokens and since <= launched <= until and launched - prev_collected < 1.0:
            gaps.append(launched - prev_collected)
    return gaps


@dataclass(frozen=True)
class BurstPhases:
    """Where a burst's time went, in seconds from its first HTTP start (see the module's docstring)."""

    first_tower: float | None  # None: no tower batch (text, or every image cached)
    first_step: float  # the first step's launch returning
    prompt_end: float  # the last prompt step's read-back
    prompt_steps: int
    prompt_tokens: int
    tail_end: float  # the burst's last step's read-back
    tail_steps: int
    tail_step_p50: float | None  # median launch-to-launch spacing of the tail's steps (None: fewer than 2)
    tower_images: int
    tower_batches: int
    tower_busy: float  # sum of the batches' tower times (start to embeddings in host memory)


def burst_phases(
    t0: float, until: float, steps: list[tuple[float, float, int]], towers: list[dict[str, float]]
) -> BurstPhases | None:
    """The phases of the burst that started at t0, from the steps launched and tower batches started in [t0, until)
    (until: the next burst's start); None if no step ran."""
    own = [s for s in steps if t0 <= s[0] < until]
    if not own:
        return None
    prompt = [s for s in own if s[2]]
    prompt_end = prompt[-1][1] if prompt else own[0][0]
    tail = [s for s in own if s[0] >= prompt_end]
    spacing = [b[0] - a[0] for a, b in zip(tail, tail[1:], strict=False)]
    batches = [t for t in towers if t0 <= t["start"] < until]
    return BurstPhases(
        first_tower=min(t["start"] for t in batches) - t0 if batches else None,
        first_step=own[0][0] - t0,
        prompt_end=prompt_end - t0,
        prompt_steps=len(prompt),
        prompt_tokens=sum(s[2] for s in prompt),
        tail_end=own[-1][1] - t0,
        tail_steps=len(tail),
        tail_step_p50=statistics.median(spacing) if spacing else None,
        tower_images=int(sum(t.get("images", 0) for t in batches)),
        tower_batches=len(batches),
        tower_busy=sum(t["encoded"] - t["start"] for t in batches),
    )


def describe_phases(p: BurstPhases) -> str:
    tower = "no tower batch" if p.first_tower is None else f"first tower batch at {p.first_tower * 1e3:.0f} ms"
    tail = "" if p.tail_step_p50 is None else f", median step {p.tail_step_p50 * 1e3:.2f} ms"
    towers = ""
    if p.tower_batches:
        towers = f"; towers: {p.tower_images} images in {p.tower_batches} batches, {p.tower_busy:.3f} s"
    return (
        f"{tower}, first step at {p.first_step * 1e3:.0f} ms; prompts until {p.prompt_end:.3f} s ({p.prompt_steps} "
        f"steps, {p.prompt_tokens} tokens); decode tail until {p.tail_end:.3f} s ({p.tail_steps} steps{tail})"
        f"{towers}"
    )


def tower_batches(lines) -> list[dict[str, float]]:
    """The visual process's batches: start, encoded, done, first_arrived (s), decode_ms, preprocess_ms and images."""
    out = []
    for line in lines:
        f = debug_fields(line)
        if f is not None and "tower batch:" in line:
            out.append({k: float(f[k]) for k in ("start", "encoded", "done", "first_arrived", "decode_ms",
                                                  "preprocess_ms", "images") if k in f})  # fmt: skip
    return out


def single_request_stages(req: dict[str, float], towers: list[dict[str, float]]) -> dict[str, float]:
    """One lone request's stages (s), in order (see the module's docstring); the visual ones only if a tower batch
    took its image (a cached image takes none)."""
    stages = {"read+parse": req["read+parse"]}
    if "load+hash" in req:
        stages["load+hash"] = req["load+hash"]
    end = req.get("router_arrived", req["first_token_at"])
    batch = next((t for t in towers if req["http_start"] <= t["first_arrived"] <= end), None)
    if batch is not None and "decode_ms" in batch:
        sent = req["http_start"] + req["read+parse"] + req.get("load+hash", 0.0)
        decode, preprocess = batch["decode_ms"] / 1e3, batch["preprocess_ms"] / 1e3
        stages["to visual"] = batch["first_arrived"] - sent
        stages["decode"], stages["preprocess"] = decode, preprocess
        stages["pool hand-off"] = batch["start"] - batch["first_arrived"] - decode - preprocess
        stages["tower"] = batch["encoded"] - batch["start"]
        stages["write"] = batch["done"] - batch["encoded"]
        stages["back to router"] = end - batch["done"]
    stages["router"] = req["router"]
    stages["server total"] = req["first_token_at"] - req["http_start"]
    return stages


def print_single(reqs: dict[str, dict[str, float]], towers: list[dict[str, float]]) -> None:
    rows = [single_request_stages(r, towers) for r in sorted(reqs.values(), key=lambda r: r["http_start"])]
    if not rows:
        return
    names = [n for n in SINGLE_STAGES if any(n in row for row in rows)]
    print("stage (ms)      " + " ".join(f"{n:>14s}" for n in names))
    medians = [statistics.median([row[n] for row in rows if n in row]) * 1e3 for n in names]
    print(f"median of {len(rows):<5d} " + " ".join(f"{m:14.1f}" for m in medians))
    for row in rows:
        print(" " * 16 + " ".join(f"{row[n] * 1e3:14.1f}" if n in row else " " * 14 for n in names))


def _quantiles(values: list[float]) -> str:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return f"p50 {statistics.median(v) * 1e3:7.1f}  p10 {pick(0.1) * 1e3:7.1f}  p90 {pick(0.9) * 1e3:7.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--min_requests", type=int, default=16)
    ap.add_argument("--single", action="store_true", help="requests sent one at a time: each one's stages")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        lines = f.readlines()
    reqs, steps = requests_and_steps(lines)
    if args.single:
        print_single(reqs, tower_batches(lines))
        return
    towers = tower_batches(lines)
    all_bursts = bursts(reqs)
    for i, burst in enumerate(all_bursts):
        if len(burst) < args.min_requests:
            continue
        t0, t1 = burst[0]["http_start"], max(r["first_token_at"] for r in burst)
        until = all_bursts[i + 1][0]["http_start"] if i + 1 < len(all_bursts) else float("inf")
        print(f"burst at {t0:.3f}: {len(burst)} requests")
        for name, values in burst_stages(burst).items():
            if values:
                print(f"  {name:13s} {_quantiles(values)}")
        gaps = prompt_step_host_gaps(steps, t0, t1)
        if gaps:
            print(f"  {'step host':13s} {_quantiles(gaps)}  ({len(gaps)} prompt steps)")
        phases = burst_phases(t0, until, steps, towers)
        if phases is not None:
            print(f"  {'phases':13s} {describe_phases(phases)}")


if __name__ == "__main__":
    main()
