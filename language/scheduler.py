"""Admission and batching: the Efficient Router. A waiting request joins the running batch only if the batch's
projected peak KV use, were every request to run to its max_new_tokens, stays within the cache — so decoding
never runs out of slots."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from language.request import Request, RequestStatus


def future_slots(req: Request) -> tuple[int, int]:
    """(slots held once admitted, slots it may still add). The last sampled token is never stored, so a request
    peaks at prompt_len + max_new_tokens - 1 slots."""
    held = req.seq_len - 1 if req.output_ids else req.prompt_len
    return held, req.prompt_len + req.params.max_new_tokens - 1 - held


def lockstep_peak(usage: list[tuple[int, int]]) -> int:
    """Peak total slots of (held, remaining) requests that all add one slot per step until done: sorted by
    remaining (longest first), the batch peaks just before the i-th request finishes, holding the first i requests'
    slots plus i x its remaining."""
    peak, held_sum = 0, 0
    for i, (held, remaining) in enumerate(sorted(usage, key=lambda hr: -hr[1]), start=1):
        held_sum += held
        peak = max(peak, held_sum + remaining * i)
    return peak


def projected_peak(running: list[Request], admitted: list[Request]) -> int:
    """Peak slots if `admitted` join `running` this step and every request decodes to its limit. This step the
    running requests store one more token each while the admitted ones store their prompts, so the two groups are a
    step apart: count this step's total, then project the survivors in lockstep from their state after it."""
    run = [future_slots(r) for r in running]
    new = [future_slots(r) for r in admitted]
    now = sum(held + 1 for held, _ in run) + sum(held for held, _ in new)
    later = [(held + 1, rem - 1) for held, rem in run if rem > 1] + [(held, rem) for held, rem in new if rem > 0]
    return max(now, lockstep_peak(later))


@dataclass
class ScheduleResult:
    prefill: list[Request]
    decode: list[Request]


class Scheduler:
    def __init__(self, max_total_tokens: int, max_running: int, max_prefill_tokens: int):
        self.max_total_tokens = max_total_tokens
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def can_ever_fit(self, req: Request) -> bool:
        return projected_peak([], [req]) <= self.max_total_tokens

    def schedule(self, has_free_row) -> ScheduleResult:
        """Admit waiting requests in arrival order while the projected peak fits; decode every running request."""
        decode = list(self.running)
        admitted: list[Request] = []
        prefill_tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_running and has_free_row(len(admitted)):
            cand = self.waiting[0]
            if admitted and prefill_tokens + cand.prompt_len > self.max_prefill_tokens:
                break
            if projected_peak(self.running, admitted + [cand]) > self.max_total_tokens:
                break  # FIFO: later requests wait behind it rather than starve it
            admitted.append(self.waiting.popleft())
            prefill_tokens += cand.prompt_len
        for req in admitted:
            req.status = RequestStatus.RUNNING
        self.running.extend(admitted)
        return ScheduleResult(prefill=admitted, decode=decode)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
