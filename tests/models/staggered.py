"""Driving an engine as a server does under load: requests join while others decode (mixed steps), then each
answer is checked against HF generate's greedy tokens."""

from __future__ import annotations

from language.engine import EngineCore
from language.request import Request
from tests.models.hf_reference import hf_greedy


def run_staggered(engine: EngineCore, reqs: list[Request], join_every: int, at_once: int = 0) -> None:
    """Add the first `at_once` requests together, then one more every `join_every` steps; step until all finish."""
    for r in reqs[:at_once]:
        engine.add_request(r)
    added = at_once
    for step in range(400):
        if step % join_every == 0 and added < len(reqs):
            engine.add_request(reqs[added])
            added += 1
        engine.step()
        if added == len(reqs) and not engine.has_unfinished():
            break


def assert_greedy_equals_hf(engine: EngineCore, reqs: list[Request], hf_model, new_tokens: int) -> None:
    """Every request's answer is HF's, and every KV slot is free again."""
    for r in reqs:
        assert r.output_ids == hf_greedy(hf_model, r.prompt_ids, new_tokens), r.rid
    assert engine.stats().kv_used == 0
