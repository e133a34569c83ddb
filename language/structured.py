"""Structured output in the engine: requests wait, unscheduled, until their grammar has compiled; each then runs
with its own xgrammar GrammarMatcher (`Request.grammar`), which accepts every token collected for it; and a step
holding constrained rows gets their token bitmask, filled on the host and copied to the device while the device
runs that step's forward.

Only steps with constrained rows do any of this: `live` (running requests with a matcher) is checked once per step."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from language.grammar import GrammarError, Grammars
from language.pinned_staging import PinnedStaging
from language.request import Request

_IDLE_WAIT_S = 0.005  # with nothing else to run, how long one step waits for a grammar to compile
# A step's mask fill may take this long. The fill runs in the engine's loop, which every request waits for, and an
# ambiguous grammar's matcher (xgrammar's Earley parser) grows with each token it accepts: the regex
# ((a|aa|aaa)*(a|aa)*)*b took 4 ms a fill after 50 a's, 240 ms after 150 and seconds after 300 on one CPU core
# (tests/unit/language/test_engine_structured.py). Past the budget, each row is timed alone and the slowest end with
# a 400 until the rest fit; a row faster than ROW_FLOOR_S never does (schemas' and tools' masks take microseconds).
FILL_BUDGET_S = 0.05
ROW_FLOOR_S = 0.005
SLOW_GRAMMAR = "the constraint grew too slow to match (an ambiguous grammar or regex): {ms:.0f} ms for one token's mask"


class StructuredDecoding:
    def __init__(self, grammars: Grammars, device: torch.device):
        self.grammars = grammars
        self.pending: list[tuple[Request, Future]] = []  # requests whose grammar is compiling
        self.live = 0  # requests holding a matcher
        self._words = -(-grammars.vocab_size // 32)  # int32 words per bitmask row
        self._staging = PinnedStaging(device, torch.int32)
        self._batch = None  # an xgrammar BatchGrammarMatcher (its thread pool), made on the first batch

    def submit(self, req: Request) -> None:
        self.pending.append((req, self.grammars.compile(req.params.structured)))

    def ready(self, idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose grammar has compiled, each now holding its matcher, and those whose grammar
        failed to compile, with xgrammar's message (requests finished meanwhile are dropped). idle: nothing else
        runs, so wait a little for a compile rather than spin."""
        if idle:
            wait([f for _, f in self.pending], timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        compiled, failed, still = [], [], []
        for req, future in self.pending:
            if req.finished:
                continue
            if not future.done():
                still.append((req, future))
                continue
            try:
                req.grammar = self.grammars.matcher(future.result())
            except GrammarError as e:
                failed.append((req, str(e)))
                continue
            self.live += 1
            compiled.append(req)
        self.pending = still
        return compiled, failed

    def release(self, req: Request) -> None:
        """The request finished: its matcher goes."""
        req.grammar = None
        self.live -= 1

    def clear(self) -> None:
        """Every request was dropped (a failed step): nothing waits and nothing holds a matcher."""
        self.pending, self.live = [], 0

    @staticmethod
    def constrained(reqs: list[Request]) -> bool:
        return any(r.grammar is not None for r in reqs)

    def advance(self, collected: list[tuple[Request, int]]) -> list[Request]:
        """Each constrained request's matcher accepts its newly collected token (all in one call to xgrammar's batch
        matcher); returns the requests whose grammar has ended there (it accepted a stop id) or that sampled a token
        the grammar rejects (an EOS that min_new_tokens banned left the row nothing else): they finish as on EOS."""
        rows = [(req, token) for req, token in collected if req.grammar is not None]
        if not rows:
            return []
        matchers = [req.grammar for req, _ in rows]
        accepted = self._batch_matcher().batch_accept_token(matchers, [token for _, token in rows])
        return [req for (req, _), ok, m in zip(rows, accepted, matchers, strict=True) if not ok or m.is_terminated()]

    def token_mask(
        self, sampled: list[tuple[Request, int]]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[tuple[Request, str]]]:
        """For the kept rows of running constrained requests: (rows, bitmask) on the device, filled from their
        matchers now (after the previous step's tokens were accepted), copied without waiting (None if none); and
        the requests whose grammar grew too slow (FILL_BUDGET_S), each with why, for the engine to end."""
        rows = [(row, r) for r, row in sampled if r.grammar is not None and not r.finished]
        if not rows:
            return None, []
        n, w = len(rows), self._words
        host = self._staging.host(n + n * w)
        host[:n] = torch.tensor([row for row, _ in rows], dtype=torch.int32)
        bitmask = host[n:].view(n, w)
        matchers = [r.grammar for _, r in rows]
        start = time.perf_counter()
        if n == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
        else:  # rows filled in parallel by xgrammar's threads
            self._batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask)
        elapsed = time.perf_counter() - start
        too_slow = []
        if elapsed > FILL_BUDGET_S:
            # timed again, so that a fill the OS merely paused (a busy host) ends nothing
            too_slow = slowest_over_budget(_timed_fills([r for _, r in rows], bitmask), elapsed)
        dev = self._staging.to_device(host)
        return (dev[:n].long(), dev[n:].view(n, w)), [(r, SLOW_GRAMMAR.format(ms=s * 1e3)) for r, s in too_slow]

    def _batch_matcher(self):
        """xgrammar's BatchGrammarMatcher (it owns a thread pool), made on first use."""
        if self._batch is None:
            import xgrammar as xgr  # imported by the compiles

            self._batch = xgr.BatchGrammarMatcher()  # threads: half the cores (more were no faster on an H100 host)
        return self._batch


def _timed_fills(reqs: list[Request], bitmask: torch.Tensor) -> list[tuple[Request, float]]:
    """A step's fill took too long: each row filled again alone, timed (the same mask: a fill reads the matcher's
    state, it does not change it). -> (request, seconds) per row."""
    timed = []
    for i, req in enumerate(reqs):
        start = time.perf_counter()
        req.grammar.fill_next_token_bitmask(bitmask, i)
        timed.append((req, time.perf_counter() - start))
    return timed


def slowest_over_budget(timed: list[tuple[Request, float]], batch_s: float) -> list[tuple[Request, float]]:
    """The rows to end, slowest first, until the rest would fill within FILL_BUDGET_S: their time alone, scaled by
    the batch's time against one row after another (below 1 where xgrammar's threads share the rows; never above,
    which only a paused thread gives). None faster than ROW_FLOOR_S."""
    left = sum(t for _, t in timed)
    scale = min(1.0, batch_s / left) if left > 0 else 1.0
    ended = []
    for req, t in sorted(timed, key=lambda row: -row[1]):
        if t <= ROW_FLOOR_S or left * scale <= FILL_BUDGET_S:
            break
        ended.append((req, t))
        left -= t
    return ended
