"""How sampled rows draw (language/draw.py) on a vocabulary wider than NARROW_K: rows with a small top-k draw from
their NARROW_K largest logits, rows without a top-k from the whole vocabulary by rejection (nucleus), rows with a
top-k above NARROW_K from their group's largest top-k logits; each follows the distribution HF's warpers leave in
vLLM's order (temperature, min-p, top-k, top-p), and a seeded row draws the same tokens whatever batch (and whatever
other paths) it runs beside."""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from language.draw import NARROW_K
from language.kernels.sampling_reference import unit_interval
from language.request import Request
from language.sampler import SamplingBatch, sample
from language.sampling_params import SamplingParams

V = NARROW_K + 476  # wider than the narrow path's columns
DRAWS = 20_000
CPU = torch.device("cpu")


def _logits() -> torch.Tensor:
    """[1, V]: a few likely tokens spread over the vocabulary (not in id order), the rest unlikely and untied (HF's
    top-k keeps every id tied with the k-th; ours keeps k)."""
    head = torch.tensor([0.31, 0.22, 0.17, 0.12, 0.07, 0.05])
    tail = torch.rand(V, generator=torch.Generator().manual_seed(0)) + 0.5
    probs = tail / tail.sum() * (1 - head.sum().item())
    probs[torch.tensor([900, 3, 1400, 77, 1200, 510])] = head
    return probs.log()[None, :]


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    reqs = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    batch = SamplingBatch.build(reqs, V, CPU)
    return sample(logits, batch).ids


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warpers in vLLM's order: temperature, min-p, top-k, top-p."""
    x = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(None, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(None, x)
    return x.softmax(dim=-1)[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),  # narrow
        SamplingParams(do_sample=True, top_k=50),  # narrow
        SamplingParams(do_sample=True, temperature=0.9, top_p=0.85),  # nucleus
        SamplingParams(do_sample=True, temperature=0.9, top_p=0.05),  # nucleus: a first draw is rarely inside
        SamplingParams(do_sample=True, temperature=1.3),  # nucleus, no cut
        SamplingParams(do_sample=True, temperature=0.9, top_k=NARROW_K + 100, top_p=0.85),  # wide top-k
        # min-p, then top-p over the mass min-p leaves: {0.31, 0.22} (HF's order, top-p first, keeps 0.17 too)
        SamplingParams(do_sample=True, top_k=50, top_p=0.6, min_p=0.5),  # narrow
        SamplingParams(do_sample=True, top_p=0.6, min_p=0.5),  # nucleus
        SamplingParams(do_sample=True, min_p=0.3),  # nucleus, min-p alone
        SamplingParams(do_sample=True, top_k=NARROW_K + 100, top_p=0.6, min_p=0.5),  # wide top-k
    ],
)
def test_each_path_follows_hfs_distribution(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = _logits()
    ids = _sample(logits.expand(DRAWS, V).clone(), [params] * DRAWS)
    freq = torch.bincount(ids, minlength=V).float() / DRAWS
    expected = _expected(logits, params)
    assert (freq[expected == 0] == 0).all()  # nothing outside the cut
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_a_seeded_row_draws_the_same_beside_any_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 2
    narrow = SamplingParams(do_sample=True, top_k=20, seed=7)
    nucleus = SamplingParams(do_sample=True, top_p=0.95, seed=7)
    wide_k = SamplingParams(do_sample=True, top_k=NARROW_K + 1, top_p=0.95, seed=7)
    others = [
        SamplingParams(),
        SamplingParams(do_sample=True, top_k=40),
        SamplingParams(do_sample=True, top_p=0.5),
        SamplingParams(do_sample=True, top_k=NARROW_K + 9),
    ]
    for seeded in (narrow, nucleus, wide_k):
        alone = _sample(logits.clone(), [seeded]).item()
        beside = _sample(torch.cat([torch.randn(len(others), V), logits]), [*others, seeded])[-1].item()
        assert alone == beside
    for params in (narrow, nucleus):  # different seeds draw different tokens
        draws = {_sample(logits.clone(), [dataclasses.replace(params, seed=s)]).item() for s in range(30)}
        assert len(draws) > 3


def test_seeded_noise_stays_inside_the_unit_interval() -> None:
    """A hash near 2^32 once rounded to u = 1.0 in fp32: an Exp(1) draw of 0 then won the race for its id whatever
    its probability (about one seeded draw in 200 over a 152k vocabulary)."""
    u = unit_interval(torch.tensor([0, 1, 2**31, 2**32 - 129, 2**32 - 1]))
    assert (u > 0).all() and (u < 1).all() and (-torch.log(u) > 0).all()
