"""The Efficient Router admission: the projected peak never exceeds the cache, so decoding never runs out."""

import random

from language.request import Request
from language.sampling_params import SamplingParams
from language.scheduler import Scheduler, projected_peak


def _req(i: int, prompt: int, new: int) -> Request:
    return Request(f"r{i}", [1] * prompt, SamplingParams(max_new_tokens=new))


def test_projected_peak_matches_simulation():
    rng = random.Random(1)
    for _ in range(200):
        reqs = [_req(i, rng.randint(1, 50), rng.randint(1, 60)) for i in range(rng.randint(1, 8))]
        # simulate: after admission each request holds prompt_len slots, then one more per step until done
        held = {r.rid: r.prompt_len for r in reqs}
        left = {r.rid: r.params.max_new_tokens - 1 for r in reqs}
        peak = sum(held.values())
        while any(left.values()):
            for rid in list(left):
                if left[rid] == 0:
                    held.pop(rid, None)
                    continue
                held[rid] += 1
                left[rid] -= 1
            peak = max(peak, sum(held.values()))
        assert projected_peak(reqs) == peak


def test_never_over_admits_under_pressure():
    """Run the scheduler against a slot budget with simulated decoding: usage never exceeds capacity."""
    rng = random.Random(2)
    capacity = 300
    sched = Scheduler(max_total_tokens=capacity, max_running=64, max_prefill_tokens=10_000)
    for i in range(60):
        sched.add(_req(i, rng.randint(5, 80), rng.randint(10, 120)))
    used, done, steps = 0, 0, 0
    while sched.waiting or sched.running:
        steps += 1
        result = sched.schedule(lambda admitted: True)
        for r in result.prefill:
            used += r.prompt_len
            r.output_ids.append(0)
        for r in result.decode:
            used += 1
            r.output_ids.append(0)
        assert used <= capacity
        for r in list(sched.running):
            if len(r.output_ids) >= r.params.max_new_tokens:
                used -= r.seq_len - 1
                sched.remove(r)
                done += 1
        assert steps < 10_000
    assert done == 60 and used == 0
