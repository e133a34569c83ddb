"""The Efficient Router with chunked prefill: budgets split prompts across steps in arrival order, and the
projected peak bounds what the engine really holds, so decoding never runs out of slots."""

import random

from language.request import Request
from language.sampling_params import SamplingParams
from language.scheduler import Scheduler, lockstep_peak, peak_slots, projected_peak


def _req(i: int, prompt: int, new: int) -> Request:
    return Request(f"r{i}", [1] * prompt, SamplingParams(max_new_tokens=new))


def _advance(plan) -> None:
    """What staging a plan does to the requests' counters."""
    for r in plan.decode:
        r.kv_len += 1
        r.num_sampled += 1
    for c in plan.prefill:
        c.req.kv_len = c.end
        c.req.num_sampled += int(c.is_last)


def _simulate(sched: Scheduler, capacity: int, rng: random.Random) -> int:
    """Drive the scheduler like the overlapped engine: a step's samples are read back one step later, so a request
    that sampled its last token holds its slots through the next step's staging. Returns the peak slots held."""
    peak, pending_finish = 0, []
    while sched.waiting or sched.running:
        plan = sched.schedule(lambda admitted: True)
        _advance(plan)  # staged before the previous step is read back
        held = sum(r.kv_len for r in sched.running)
        assert held <= capacity, "over-admitted"
        peak = max(peak, held)
        for r in pending_finish:  # the previous step is read back: its finished requests leave
            sched.remove(r)
        live = [r for r in plan.decode if r not in pending_finish]
        # Requests that sampled their last token, and a few that stop early (EOS), leave at the next read-back.
        pending_finish = [r for r in sched.running if r.sampling_done]
        pending_finish += [r for r in live if not r.sampling_done and rng.random() < 0.02]
    return peak


def test_never_over_admits_under_pressure_with_chunks():
    for seed in range(5):
        rng = random.Random(seed)
        capacity = 300
        sched = Scheduler(
            max_total_token_num=capacity,
            running_max_req_size=64,
            prefill_budget=rng.choice([7, 32, 1000]),
            chunked_prefill=True,
        )
        for i in range(60):
            sched.add(_req(i, rng.randint(5, 80), rng.randint(1, 120)))
        assert _simulate(sched, capacity, rng) <= capacity
        assert not sched.running and not sched.waiting


def test_lockstep_peak_matches_a_step_by_step_count():
    rng = random.Random(3)
    for _ in range(300):
        usage = [(rng.randint(1, 50), rng.randint(0, 40)) for _ in range(rng.randint(1, 6))]
        live, total, best = [list(u) for u in usage], sum(h for h, _ in usage), 0
        best = total
        while live:
            live = [u for u in live if u[1] > 0]
            total = sum(u[0] for u in live)
            for u in live:
                u[0] += 1
                u[1] -= 1
            total = sum(u[0] for u in live)
            best = max(best, total)
        assert lockstep_peak(usage) == best


def test_budget_splits_prompts_and_continues_them_first():
    sched = Scheduler(max_total_token_num=10_000, running_max_req_size=8, prefill_budget=10, chunked_prefill=True)
    a, b, c = _req(0, 25, 4), _req(1, 6, 4), _req(2, 3, 4)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule(lambda n: True)
    assert [(ch.req.rid, ch.start, ch.length) for ch in plan.prefill] == [("r0", 0, 10)]
    _advance(plan)
    plan = sched.schedule(lambda n: True)
    assert [(ch.req.rid, ch.start, ch.length) for ch in plan.prefill] == [("r0", 10, 10)]
    _advance(plan)
    plan = sched.schedule(lambda n: True)  # r0's last 5 tokens, then r1 is cut to the 5 left
    assert [(ch.req.rid, ch.start, ch.length) for ch in plan.prefill] == [("r0", 20, 5), ("r1", 0, 5)]
    assert plan.prefill[0].is_last and not plan.prefill[1].is_last and not plan.decode
    _advance(plan)
    plan = sched.schedule(lambda n: True)
    assert plan.decode == [a]  # r0 decodes while r1 finishes its prompt and r2 starts
    assert [(ch.req.rid, ch.length) for ch in plan.prefill] == [("r1", 1), ("r2", 3)]


def test_whole_prompts_when_chunking_is_off():
    sched = Scheduler(max_total_token_num=10_000, running_max_req_size=8, prefill_budget=10, chunked_prefill=False)
    a, b = _req(0, 25, 4), _req(1, 6, 4)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(lambda n: True)
    assert [(ch.req.rid, ch.length) for ch in plan.prefill] == [("r0", 25)]  # alone: too long for the budget
    _advance(plan)
    plan = sched.schedule(lambda n: True)
    assert [(ch.req.rid, ch.length) for ch in plan.prefill] == [("r1", 6)]


def test_admission_stops_at_the_cache_and_keeps_order():
    sched = Scheduler(max_total_token_num=99, running_max_req_size=8, prefill_budget=1000, chunked_prefill=True)
    big, small = _req(0, 40, 30), _req(1, 2, 2)  # peaks 69 and 3
    sched.add(_req(2, 30, 2))  # peak 31
    sched.add(big)
    sched.add(small)
    plan = sched.schedule(lambda n: True)
    assert [r.rid for r in plan.admitted] == ["r2"]  # 31 + 69 > 99: big waits, and small waits behind it
    assert projected_peak([], peak_slots(big)) == 69


def _image_req(prompt: int, images: list[tuple[int, int]]) -> Request:
    from language.request import MultimodalItem

    req = _req(0, prompt, 4)
    req.mm_items = [MultimodalItem(offset, None, f"img{i}", length=n) for i, (offset, n) in enumerate(images)]
    return req


def test_whole_images_never_split_across_chunks():
    """A decoder whose image tokens see each other both ways (Gemma 3): a chunk that would end inside an image ends
    before it, or, when the image starts the chunk, takes it whole over the budget."""
    sched = Scheduler(max_total_token_num=10_000, running_max_req_size=8, prefill_budget=10, chunked_prefill=True,
                      whole_images=True)  # fmt: skip
    req = _image_req(60, [(6, 16), (22, 16), (45, 3)])  # 10-token budget
    sched.add(req)
    chunks = []
    while req.kv_len < req.prompt_len:
        plan = sched.schedule(lambda admitted: True)
        chunks += [(c.start, c.end) for c in plan.prefill]
        _advance(plan)
    assert chunks == [(0, 6), (6, 22), (22, 38), (38, 48), (48, 58), (58, 60)]  # the last image ends a chunk
    plain = Scheduler(max_total_token_num=10_000, running_max_req_size=8, prefill_budget=10, chunked_prefill=True)
    other = _image_req(60, [(6, 16)])
    plain.add(other)
    assert [(c.start, c.end) for c in plain.schedule(lambda admitted: True).prefill] == [(0, 10)]
