"""A server's timeline from its `--log_level debug` log: the LM's steps, the tower's batches and the requests' stages,
in order, on the host's one monotonic clock (`time.perf_counter`, which every process of the host shares).

    python benchmarks/log_timeline.py SERVER_LOG [--since T] [--until T] [--kinds step,tower,http,router]

Times are printed from --since (default: the first event). Each line: start, end, kind, and what it did:
- step: a router step, from its launch returning to its samples being read back; its prompt tokens and decode rows
- tower: a visual batch, from its start to its embeddings in host memory (+ the shared-memory writes), its images,
  and how long its first image had waited since arriving in the visual process
- http: a request from the start of its body's read to its submission to the router (read, parse, prepare)
- router: a request from its arrival in the router to its first token leaving it
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

_FIELDS = re.compile(r"(\w+)=([-\w.]+)")


@dataclass(frozen=True)
class Event:
    start: float
    end: float
    kind: str
    what: str


def debug_fields(line: str) -> dict[str, str] | None:
    """The `name=value` fields of a DEBUG line's message, or None for any other line."""
    if " DEBUG " not in line:
        return None
    return dict(_FIELDS.findall(line.split(" DEBUG ", 1)[1]))


def parse_line(line: str) -> Event | None:
    """The event a debug line records, or None for any other line."""
    f = debug_fields(line)
    if f is None:
        return None
    if "step timing:" in line:
        start = float(f["launched"])
        return Event(start, float(f["collected"]), "step", f"prefill={f['prefill_tokens']} decode={f['decode']}")
    if "tower batch:" in line:
        start, encoded, done = float(f["start"]), float(f["encoded"]), float(f["done"])
        waited = (start - float(f["first_arrived"])) * 1e3
        what = f"tower {(encoded - start) * 1e3:.1f} ms + write {(done - encoded) * 1e3:.1f} ms, images={f['images']}"
        return Event(start, done, "tower", f"{what}, first waited {waited:.1f} ms")
    if "request timing:" in line and "start" in f and "image request" not in line:
        start = float(f["start"])
        what = f"read {f['read_ms']} parse {f['parse_ms']} prepare {f['prepare_ms']} ms"
        return Event(start, start + float(f["total_ms"]) / 1e3, "http", what)
    if "router timing:" in line:
        start = float(f["arrived"])
        return Event(start, start + float(f["first_token_ms"]) / 1e3, "router", f"first token {f['first_token_ms']} ms")
    return None


def timeline(lines, since: float | None = None, until: float | None = None, kinds: set[str] | None = None):
    events = [e for e in map(parse_line, lines) if e is not None and (kinds is None or e.kind in kinds)]
    events = [e for e in events if (since is None or e.start >= since) and (until is None or e.start <= until)]
    return sorted(events, key=lambda e: e.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--since", type=float, default=None, help="perf_counter seconds (a `start=` value of the log)")
    ap.add_argument("--until", type=float, default=None)
    ap.add_argument("--kinds", default="step,tower,http,router")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        events = timeline(f, args.since, args.until, set(args.kinds.split(",")))
    origin = args.since if args.since is not None else (events[0].start if events else 0.0)
    for e in events:
        print(f"{e.start - origin:8.3f} {e.end - origin:8.3f}  {e.kind:6s} {e.what}")


if __name__ == "__main__":
    main()
