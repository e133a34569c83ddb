"""The sort-free top-p / min-p draw against its torch reference: the same ids row for row (both race with the same
seeded noise and test the same cuts), over rows that accept at once, rows that need several rounds (a small top-p
over a flat row), rows with min-p, with top-p 1, with masked (-inf) ids, a strided view and a vocabulary that is not
a multiple of the block. And what the reference draws: each row's id is inside its nucleus, and the frequencies over
many seeds follow the nucleus's renormalised probabilities."""

import math

import pytest
import torch
from kernel_cases import DEVICE, strided_view

from language.kernels.nucleus_draw import BLOCK, nucleus_draw
from language.kernels.sampling_reference import nucleus_draw_ref


def _rows(num_rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * torch.linspace(0.2, 6.0, num_rows)[:, None]
    logits[1::4, ::7] = float("-inf")  # a grammar's mask
    temperature = torch.rand(num_rows, generator=gen) + 0.3
    top_p = torch.rand(num_rows, generator=gen) * 0.98 + 0.01
    top_p[3::5] = 1.0
    log_min_p = torch.full((num_rows,), float("-inf"))
    log_min_p[2::3] = math.log(0.05)
    seed_ = torch.randint(0, 2**62, (num_rows,), generator=gen)
    step = torch.randint(0, 5000, (num_rows,), generator=gen)
    return logits, temperature, top_p, log_min_p, seed_, step


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float, log_min_p: float) -> torch.Tensor:
    """[V] bool: the ids the cuts keep, from a sort (HF's definition, ties aside)."""
    scaled = logits / temperature
    kept = scaled >= scaled.max() + log_min_p
    probs = torch.where(kept, (scaled - scaled.max()).exp(), 0.0)
    probs = probs / probs.sum()
    above = torch.stack([probs[probs > p].sum() for p in probs])
    return kept & (above < top_p)


@pytest.mark.parametrize("num_rows, vocab", [(1, 300), (12, BLOCK + 77), (20, 2 * BLOCK)])
def test_matches_the_reference(num_rows: int, vocab: int) -> None:
    logits, *params = _rows(num_rows, vocab, seed=num_rows * vocab)
    params = [t.to(DEVICE) for t in params]
    ours = nucleus_draw(strided_view(logits.to(DEVICE), pad=5), *params)
    want = nucleus_draw_ref(logits.to(DEVICE), *params)
    assert torch.equal(ours, want), (ours, want)


def test_small_top_p_over_a_flat_row_takes_rounds_and_stays_inside() -> None:
    """A nearly flat row with top-p 0.01: a first draw is rarely inside, so rows go round after round."""
    vocab, num_rows = 500, 16
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)).expand(num_rows, vocab) * 0.1
    temperature = torch.ones(num_rows)
    top_p = torch.full((num_rows,), 0.01)
    log_min_p = torch.full((num_rows,), float("-inf"))
    seed, step = torch.arange(num_rows) * 7919, torch.zeros(num_rows, dtype=torch.int64)
    params = [t.to(DEVICE) for t in (temperature, top_p, log_min_p, seed, step)]
    ours = nucleus_draw(logits.contiguous().to(DEVICE), *params)
    want = nucleus_draw_ref(logits.to(DEVICE), *params)
    assert torch.equal(ours, want)
    inside = _nucleus(logits[0], 1.0, 0.01, float("-inf"))
    assert 1 < int(inside.sum()) < 20 and inside[want.cpu()].all()


def test_the_reference_draws_each_nucleus_by_its_probabilities() -> None:
    vocab, draws = 60, 20_000
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(vocab, generator=gen) * 1.5
    for temperature, top_p, min_p in ((0.8, 0.7, 0.0), (1.2, 1.0, 0.1), (1.0, 0.5, 0.2)):
        log_min_p = math.log(min_p) if min_p else float("-inf")
        ids = nucleus_draw_ref(
            base.expand(draws, vocab),
            torch.full((draws,), temperature),
            torch.full((draws,), top_p),
            torch.full((draws,), log_min_p),
            torch.randint(0, 2**62, (draws,), generator=gen),
            torch.zeros(draws, dtype=torch.int64),
        )
        inside = _nucleus(base, temperature, top_p, log_min_p)
        probs = torch.where(inside, (base / temperature).softmax(-1), 0.0)
        probs = probs / probs.sum()
        freq = torch.bincount(ids, minlength=vocab).float() / draws
        assert (freq - probs).abs().max() < 0.012, (temperature, top_p, min_p)


def test_a_vanishing_top_p_keeps_the_most_likely_id_at_once() -> None:
    """top_p whose product with the mass rounds to 0 (a denormal, flushed on the GPU): the most likely id is inside
    all the same, as HF keeps the first, found by the rounds that follow a winner outside (none runs to the cap)."""
    logits, temperature, _, log_min_p, seed, step = _rows(6, 700, seed=5)
    top_p = torch.full((6,), 1e-45)
    params = [t.to(DEVICE) for t in (temperature, top_p, log_min_p, seed, step)]
    ours = nucleus_draw(logits.to(DEVICE), *params)
    assert torch.equal(ours.cpu(), (logits / temperature[:, None]).argmax(dim=-1))
    assert torch.equal(ours, nucleus_draw_ref(logits.to(DEVICE), *params))
