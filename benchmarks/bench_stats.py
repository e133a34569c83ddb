"""Figures from streamed responses: percentiles, time to first token, time per output token.

A server may stream one event per output token (LightLLM v1.2.0 and mmserve do) or fewer (an older mmserve sent one
per non-empty text piece, ids that decoded to no text riding along with the next one). TPOT is read from the events'
arrival times only when every request got exactly one event per token; otherwise it is (latency - TTFT) / (tokens -
1). TTFT is always the arrival of the first event; when a first event carried more than one token the first token
came earlier than that, and the summary says so (`ttft_caveat`), adding the response headers' arrival
(`headers_p50_s`; mmserve answers 200 only once the first token is out, so for mmserve that is the first token's
time, while LightLLM answers at once) and the TPOT counted from it (`tpot_from_headers_p50_ms`).

A multi-turn chat load adds medians per turn (`by_turn`): TTFT, prompt tokens and, with the caveat, headers."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PER_EVENT = "per_event"
LATENCY_MINUS_TTFT = "latency_minus_ttft"


@dataclass
class RequestResult:
    latency: float = 0.0  # s from sending to the end of the stream
    headers: float | None = None  # s from sending to the response headers (mmserve sends them at the first token)
    events: list[tuple[float, int | None]] = field(default_factory=list)  # (s since sending, cumulative tokens)
    tokens: int = 0  # count_output_tokens of the final event
    prompt_tokens: int | None = None
    error: str | None = None
    text: str = ""  # the streamed text pieces joined (a chat's answer, fed back in its next turn)
    first_chunk: float | None = None  # OpenAI API: s to the first chunk, content or not (the assistant role's)
    no_text: bool = False  # OpenAI API: no token decoded to text, so the first event is `first_chunk`

    @property
    def ttft(self) -> float | None:
        return self.events[0][0] if self.events else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in 0..100."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def one_event_per_token(r: RequestResult) -> bool:
    """True when the stream had exactly one event per output token: as many events as tokens, and, where the events
    carry cumulative counts, those counts step 1, 2, ..., N."""
    if r.tokens < 1 or len(r.events) != r.tokens:
        return False
    counts = [c for _, c in r.events]
    return all(c is None for c in counts) or counts == list(range(1, r.tokens + 1))


def tpot_method(results: list[RequestResult]) -> str:
    ok = [r for r in results if r.error is None and r.tokens > 1]
    return PER_EVENT if ok and all(one_event_per_token(r) for r in ok) else LATENCY_MINUS_TTFT


def request_tpot(r: RequestResult, method: str) -> float | None:
    """Seconds per output token after the first, for one request."""
    if r.error is not None or r.tokens < 2 or not r.events:
        return None
    if method == PER_EVENT:
        return (r.events[-1][0] - r.events[0][0]) / (r.tokens - 1)
    return (r.latency - r.events[0][0]) / (r.tokens - 1)


def inter_event_gaps(results: list[RequestResult]) -> list[float]:
    return [b[0] - a[0] for r in results if r.error is None for a, b in zip(r.events, r.events[1:], strict=False)]


def first_event_tokens(r: RequestResult) -> int | None:
    """Tokens the first event carried (its cumulative count), or None where the server does not say."""
    return r.events[0][1] if r.events else None


def summarize(results: list[RequestResult], wall: float, sequential: bool = False) -> dict:
    """One load's figures. `sequential`: requests ran one at a time, so TTFT/TPOT "p50" are medians of the repeats."""
    ok = [r for r in results if r.error is None and r.events]
    method = tpot_method(ok)
    ttft = [r.ttft for r in ok]
    tpot = [t for t in (request_tpot(r, method) for r in ok) if t is not None]
    tokens = sum(r.tokens for r in ok)
    out: dict = {
        "num_requests": len(results),
        "req_per_s": len(ok) / wall if wall > 0 else math.nan,
        "out_tok_per_s": tokens / wall if wall > 0 else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "tpot_method": method,
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "wall_s": wall,
    }
    if method == PER_EVENT:
        out["itl_p50_ms"] = percentile(inter_event_gaps(ok), 50) * 1e3
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    if prompts:
        out["prompt_tokens_p50"] = statistics.median(prompts)
    out["output_tokens_min"] = min((r.tokens for r in ok), default=0)
    out.update(first_chunk_figures(ok))
    late = [n for n in (first_event_tokens(r) for r in ok) if n is not None and n > 1]
    if late:
        out["ttft_caveat"] = (
            f"in {len(late)} of {len(ok)} requests the first event carried >1 tokens (up to {max(late)}): "
            "the server sent nothing for tokens without text, so TTFT there is late"
        )
        # mmserve answers 200 only once the first token is out, so there its response headers time the first token
        timed = [r for r in ok if r.headers is not None]
        if timed:
            out["headers_p50_s"] = percentile([r.headers for r in timed], 50)
            out["headers_p99_s"] = percentile([r.headers for r in timed], 99)
            per_tok = [(r.latency - r.headers) / (r.tokens - 1) for r in timed if r.tokens > 1]
            out["tpot_from_headers_p50_ms"] = percentile(per_tok, 50) * 1e3
    if sequential:
        out["sequential"] = True
    errors = [r.error for r in results if r.error is not None]
    if errors:
        out["errors"] = len(errors)
        out["first_error"] = errors[0][:300]
    return out


def first_chunk_figures(ok: list[RequestResult]) -> dict:
    """OpenAI API streams: the first chunk's arrival (both vLLM and mmserve send it, the assistant role alone, once
    the first token is out, whether or not that token decodes to text), and how many requests had no text at all."""
    firsts = [r.first_chunk for r in ok if r.first_chunk is not None]
    if not firsts:
        return {}
    out = {"first_chunk_p50_s": percentile(firsts, 50), "first_chunk_p99_s": percentile(firsts, 99)}
    no_text = sum(r.no_text for r in ok)
    if no_text:
        out["no_text_requests"] = no_text  # their TTFT is the first chunk's
    return out


def _median_or_none(values: list[float], scale: float = 1.0, digits: int = 2) -> float | None:
    return round(statistics.median(values) * scale, digits) if values else None


def by_turn(conversations: list[list[RequestResult]], with_headers: bool = False) -> dict:
    """Per-turn medians of a chat load, `conversations[c][k]` being conversation c's turn k+1: lists indexed by turn,
    over the turns that finished (None where none did). `with_headers` adds the response headers' arrival."""
    turns = max((len(conv) for conv in conversations), default=0)
    grouped: list[list[RequestResult]] = [[] for _ in range(turns)]
    for conv in conversations:
        for k, r in enumerate(conv):
            if r.error is None and r.events:
                grouped[k].append(r)
    out: dict = {
        "ttft_by_turn_ms": [_median_or_none([r.ttft for r in rs], 1e3) for rs in grouped],
        "prompt_tokens_by_turn": [
            _median_or_none([r.prompt_tokens for r in rs if r.prompt_tokens is not None], digits=1) for rs in grouped
        ],
        "finished_by_turn": [len(rs) for rs in grouped],
    }
    if with_headers:
        out["headers_by_turn_ms"] = [
            _median_or_none([r.headers for r in rs if r.headers is not None], 1e3) for rs in grouped
        ]
    return out
