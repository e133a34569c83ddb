"""Penalties from counts kept on the device (language/penalties.py): over many steps, with requests joining and
finishing (their rows reused, the tables grown), the engine's tables penalise every row exactly as tables rebuilt from
each request's host history do."""

import random

import torch

from language.penalties import PenaltyTables, apply_penalties
from language.request import Request
from language.sampler import SamplingBatch, sample
from language.sampling_params import SamplingParams

V = 64
KINDS = [
    SamplingParams(repetition_penalty=1.4),
    SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(presence_penalty=0.9, input_penalty=True, do_sample=True, temperature=0.8),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4),
    SamplingParams(),  # none: row 0 in a batch that has some
]


def _rebuilt(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """What the penalties make of `logits` from tables filled from each request's prompt and outputs alone."""
    batch = SamplingBatch.build(reqs, V, torch.device("cpu"))
    return apply_penalties(logits, batch.penalties, batch.penalty_tables)


def test_counts_kept_across_steps_equal_a_rebuild_from_each_history() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    tables = PenaltyTables(V, torch.device("cpu"))
    running: list[Request] = []
    joined = 0
    for step in range(60):
        while len(running) < 14 and rng.random() < 0.5:  # up to 14 at once: the tables grow past their first 8 rows
            prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
            running.append(Request(f"r{joined}", prompt, KINDS[joined % len(KINDS)]))
            joined += 1
        if not running:
            continue
        logits = torch.randn(len(running), V) * 3
        batch = SamplingBatch.build(running, V, torch.device("cpu"), penalty_tables=tables)
        kept = apply_penalties(logits, batch.penalties, tables)
        assert torch.equal(kept, _rebuilt(logits, running)), step
        ids = sample(logits, batch).ids  # counts its samples into the tables
        for r, token in zip(running, ids.tolist(), strict=True):
            r.output_ids.append(token)
            r.num_sampled += 1
        for r in [r for r in running if rng.random() < 0.15]:  # finished: the row goes back, to be taken again
            tables.release(r)
            running.remove(r)
    assert joined > 20 and tables.counts.shape[0] > 9


def test_a_row_is_cleared_when_taken_again() -> None:
    tables = PenaltyTables(V, torch.device("cpu"))
    params = SamplingParams(presence_penalty=1.0, repetition_penalty=2.0)
    first = Request("a", [5, 6], params)
    batch = SamplingBatch.build([first], V, torch.device("cpu"), penalty_tables=tables)
    tables.count(batch.penalties, torch.tensor([7]))
    tables.release(first)
    second = Request("b", [9], params)
    batch = SamplingBatch.build([second], V, torch.device("cpu"), penalty_tables=tables)
    logits = torch.ones(1, V)
    out = apply_penalties(logits, batch.penalties, tables)[0]
    assert out[9] == 0.5 and out[5] == out[6] == out[7] == 1.0  # only its own prompt id
    assert batch.penalties.rows.tolist() == [1]  # the first request's row, reused
