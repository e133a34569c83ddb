"""Batched sampling against HF's logits processors and basic distribution properties."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from language.draw import cut_sorted
from language.penalties import apply_penalties
from language.request import Request
from language.sampler import SamplingBatch, sample
from language.sampling_params import SamplingParams

V = 50
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _reqs(*params: SamplingParams, prompt=(1, 2, 3, 3), outputs=()):
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(prompt), p)
        r.output_ids = list(outputs)
        reqs.append(r)
    return reqs


def _batch(reqs):
    return SamplingBatch.build(reqs, V, torch.device("cpu"))


def _penalised(logits, reqs):
    batch = _batch(reqs)
    return apply_penalties(logits, batch.penalties, batch.penalty_tables)


def test_greedy_rows_take_argmax_and_report_logprob():
    logits = torch.randn(3, V)
    ids, lp, *_ = sample(logits.clone(), _batch(_reqs(SamplingParams(), SamplingParams(), SamplingParams())))
    assert ids.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(lp, torch.log_softmax(logits, -1).max(-1).values)


def test_top_k_one_is_greedy_even_when_sampling():
    logits = torch.randn(4, V)
    p = SamplingParams(do_sample=True, temperature=1.5, top_k=1)
    ids, *_ = sample(logits.clone(), _batch(_reqs(p, p, p, p)))
    assert ids.tolist() == logits.argmax(-1).tolist()


def test_repetition_penalty_matches_hf():
    logits = torch.randn(1, V)
    reqs = _reqs(SamplingParams(repetition_penalty=1.7), outputs=(7, 7, 9))
    ours = _penalised(logits.clone(), reqs)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 3, 3, 7, 7, 9]]), logits.clone())
    assert torch.allclose(ours, hf)


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(1, V)
    reqs = _reqs(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), outputs=(7, 7, 9))
    out = _penalised(logits, reqs)[0]
    assert out[7].item() == -(2 * 0.5 + 0.25) and out[9].item() == -(0.5 + 0.25)
    assert out[3].item() == 0.0  # prompt tokens are not penalised by frequency/presence


def test_top_k_top_p_keep_the_same_support_as_hf():
    torch.manual_seed(0)
    logits = torch.randn(2, V) * 3
    ordered, order = logits.sort(dim=-1, descending=True)
    cut = cut_sorted(ordered, torch.tensor([10, V]), torch.tensor([0.6, 0.8]))
    ours = torch.empty_like(logits).scatter_(1, order, cut)
    for row, (k, p) in enumerate([(10, 0.6), (V, 0.8)]):
        hf = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, logits[row : row + 1].clone()))
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(hf[0]))


def test_seeded_requests_repeat_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    p = SamplingParams(do_sample=True, temperature=1.0, seed=1234)
    alone, *_ = sample(logits.clone(), _batch(_reqs(p)))
    other = SamplingParams(do_sample=True, temperature=0.7)
    together, *_ = sample(torch.cat([torch.randn(1, V), logits]), _batch(_reqs(other, p)))
    assert alone.item() == together[1].item()
    draws = {sample(logits.clone(), _batch(_reqs(SamplingParams(do_sample=True, seed=s))))[0].item() for s in range(40)}
    assert len(draws) > 3  # different seeds draw different tokens


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (V - 3)]))
    p = SamplingParams(do_sample=True)
    ids, *_ = sample(logits.expand(4000, V).clone(), _batch(_reqs(*[p] * 4000)))
    freq = torch.bincount(ids, minlength=V)[:3].float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_greedy_fast_path_equals_general_sampler():
    from language.sampler import sample_greedy

    logits = torch.randn(6, V) * 4
    greedy, sampling = SamplingParams(), SamplingParams(do_sample=True, temperature=0.7)
    fast_ids, fast_lp, *_ = sample_greedy(logits.clone())
    # A batch that is not all greedy goes through the general path; its greedy rows must agree.
    ids, lp, *_ = sample(logits.clone(), _batch(_reqs(*[greedy] * 5, sampling)))
    assert fast_ids[:5].tolist() == ids[:5].tolist()
    torch.testing.assert_close(fast_lp[:5], lp[:5])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_every_path_takes_the_heads_bf16_logits_as_their_fp32_upcast(device):
    """The models hand the sampler their LM head's dtype: the greedy kernel (on CUDA) reads it as it is, the other
    paths upcast it; all of them give what they give on the fp32 copy."""
    from language.sampler import sample_greedy

    logits = (torch.randn(6, 5000) * 6).to(torch.bfloat16).to(device)  # bf16: ties among the maxima too
    upcast = logits.float()
    ids, lp, *_ = sample_greedy(logits)
    want_ids, want_lp, *_ = sample_greedy(upcast.cpu())
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(lp.cpu(), want_lp, atol=1e-5, rtol=1e-5)
    greedy = SamplingBatch.build(_reqs(*[SamplingParams()] * 6), 5000, torch.device(device))
    general = sample(logits, greedy)
    assert general.ids.tolist() == ids.tolist()
    torch.testing.assert_close(general.logprobs, sample(upcast, greedy).logprobs)
    top = sample_greedy(logits, 3)
    assert top.ids.tolist() == ids.tolist() and torch.equal(top.top_ids[:, 0], top.ids)
