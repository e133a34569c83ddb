"""The sampler's top-k log-probabilities against a torch reference (log_softmax, then topk): the greedy fast path,
the full path with penalties and masks, the rows that ask next to rows that do not, and prompt scoring."""

import pytest
import torch

from language.penalties import apply_penalties
from language.request import Request
from language.sampler import SamplingBatch, sample, sample_greedy, token_logprobs
from language.sampling_params import SamplingParams

V = 64


def _reqs(*params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3, 3], p) for i, p in enumerate(params)]


def _reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return ids, values


def test_greedy_fast_path_top_k_equals_log_softmax_topk():
    logits = torch.randn(5, V) * 3
    out = sample_greedy(logits.clone(), 7)
    ids, values = _reference(logits, 7)
    assert out.ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_logprobs, values, rtol=0, atol=1e-5)
    assert torch.equal(out.top_ids[:, 0], out.ids)  # greedy: the chosen token is the most likely one
    torch.testing.assert_close(out.top_logprobs[:, 0], out.logprobs, rtol=0, atol=1e-6)


def test_no_row_asking_computes_nothing():
    logits = torch.randn(3, V)
    assert sample_greedy(logits, 0).top_ids is None
    batch = SamplingBatch.build(_reqs(SamplingParams(do_sample=True), SamplingParams()), V, torch.device("cpu"))
    assert batch.top_logprobs == 0 and sample(torch.randn(2, V), batch).top_ids is None


def test_full_path_alternatives_come_from_the_distribution_the_token_was_chosen_from():
    """Penalties, bias and masks shape the distribution; temperature and top-p do not enter the logprobs."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 2
    params = [
        SamplingParams(top_logprobs=5, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(),  # asks for none: computed anyway (one topk for the batch), never read
        SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=3, top_logprobs=20),
        SamplingParams(top_logprobs=3, logit_bias=((9, 50.0),), allowed_token_ids=tuple(range(8, 40))),
    ]
    reqs = _reqs(*params)
    for r in reqs:
        r.output_ids = [7, 7, 9]
    batch = SamplingBatch.build(reqs, V, torch.device("cpu"))
    assert batch.top_logprobs == 20
    # before sampling, which counts its samples into the tables for the next step
    shaped = batch.processors.apply(apply_penalties(logits.clone(), batch.penalties, batch.penalty_tables))
    out = sample(logits.clone(), batch)
    ids, values = _reference(shaped, 20)
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_logprobs, values, rtol=0, atol=1e-5)
    chosen = torch.log_softmax(shaped, -1).gather(1, out.ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, chosen, rtol=0, atol=1e-5)
    # the allowed set (32 ids) leaves the rest at -inf: those never rank above an allowed id; the bias puts 9 first
    assert set(out.top_ids[3, :3].tolist()) <= set(range(8, 40)) and out.top_ids[3, 0].item() == 9


@pytest.mark.parametrize("k", [0, 4])
def test_token_logprobs_scores_given_ids_as_log_softmax(k):
    logits = torch.randn(9, V) * 4
    targets = torch.randint(0, V, (9,))
    out = token_logprobs(logits, targets, k)
    expected = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-5)
    if k:
        ids, values = _reference(logits, k)
        assert torch.equal(out.top_ids, ids)
        torch.testing.assert_close(out.top_logprobs, values, rtol=0, atol=1e-5)
