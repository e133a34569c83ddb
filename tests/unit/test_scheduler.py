"""The Efficient Router admission: the projected peak never exceeds the cache, so decoding never runs out."""

import random

from language.request import Request
from language.sampling_params import SamplingParams
from language.scheduler import Scheduler, future_slots, projected_peak


def _req(i: int, prompt: int, new: int) -> Request:
    return Request(f"r{i}", [1] * prompt, SamplingParams(max_new_tokens=new))


def _simulate_peak(running: list[Request], admitted: list[Request]) -> int:
    """Step by step, as the engine allocates: this step each running request stores one token and each admitted one
    its prompt; afterwards every live request stores one token per step; a request frees all its slots once its
    last token is sampled (max_new_tokens reached)."""
    live = {}  # rid -> [slots held, slots still to add]
    total = 0
    for r in running:
        held, rem = future_slots(r)
        live[r.rid] = [held + 1, rem - 1]
        total += held + 1
    for r in admitted:
        held, rem = future_slots(r)
        live[r.rid] = [held, rem]
        total += held
    peak = total
    while live:
        for rid in [rid for rid, (_, rem) in live.items() if rem == 0]:
            total -= live.pop(rid)[0]
        for state in live.values():
            state[0] += 1
            state[1] -= 1
            total += 1
        peak = max(peak, total)
    return peak


def _running(i: int, prompt: int, new: int, done: int) -> Request:
    r = _req(i, prompt, new)
    r.output_ids = [0] * done  # `done` tokens sampled so far (1 after prefill)
    return r


def test_projected_peak_matches_simulation():
    rng = random.Random(1)
    for _ in range(500):
        running = []
        for i in range(rng.randint(0, 6)):
            new = rng.randint(2, 60)
            running.append(_running(i, rng.randint(1, 50), new, rng.randint(1, new - 1)))
        admitted = [_req(100 + i, rng.randint(1, 50), rng.randint(1, 60)) for i in range(rng.randint(0, 4))]
        if running or admitted:
            assert projected_peak(running, admitted) == _simulate_peak(running, admitted)


def test_new_requests_lag_running_ones_by_a_step():
    """The case that once over-admitted: running requests advance in the admission step, new ones only prefill."""
    running = [_running(0, 9, 34, 28), _running(1, 27, 2, 1)]  # (held 36, 6 left) and (27, 1 left)
    admitted = [_req(2, 3, 37), _req(3, 14, 23)]
    assert projected_peak(running, admitted) == _simulate_peak(running, admitted)


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
