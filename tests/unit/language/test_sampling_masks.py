"""Logit processors of the batched sampler: allowed_token_ids, logit_bias, min_new_tokens, the EOS length boost and
input_penalty, each against what it must do, mixed in one batch with plain rows."""

import torch
from transformers.generation.logits_process import ExponentialDecayLengthPenalty

from language.penalties import apply_penalties
from language.request import Request
from language.sampler import LogitProcessors, SamplingBatch, sample
from language.sampling_params import SamplingParams

V = 64
EOS = (2,)


def _req(p: SamplingParams, sampled_before: int = 0, prompt=(5, 6, 7)) -> Request:
    r = Request("r", list(prompt), p.validate())
    r.num_sampled = sampled_before + 1  # staging counted the token this step samples
    return r


def _sample(logits, reqs):
    return sample(logits.clone(), SamplingBatch.build(reqs, V, torch.device("cpu"), EOS))


def test_allowed_token_ids_keep_every_sample_in_the_set():
    allowed = (3, 17, 40)
    hot = SamplingParams(do_sample=True, temperature=2.0, allowed_token_ids=allowed)
    greedy = SamplingParams(allowed_token_ids=allowed)
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(3, V) * 5
        logits[:, 0] = 50.0  # the unconstrained favourite is outside the set
        ids, lps, *_ = _sample(logits, [_req(hot), _req(greedy), _req(SamplingParams())])
        assert ids[0].item() in allowed and ids[1].item() in allowed
        assert ids[1].item() == max(allowed, key=lambda t: logits[1, t].item())  # greedy: best of the set
        assert ids[2].item() == 0  # the plain row in the same batch is untouched
        assert torch.isfinite(lps).all()


def test_each_requests_edits_are_built_once_however_long_its_lists():
    """A request's allowed ids, bias and banned ids become tensors on its first step and are reused after (the
    engine's loop, which every request waits for, does no per-step work over a million duplicated ids): the same
    edits, each id once, on every step."""
    p = SamplingParams(allowed_token_ids=(3, 17, 40) * 300_000, stop_token_ids=(9,) * 300_000, min_new_tokens=4,
                       logit_bias=((5, 1.5),)).validate()  # fmt: skip
    r = _req(p)
    first = LogitProcessors.build([_req(SamplingParams()), r], EOS, V, torch.device("cpu"))
    edits = r.logit_edits
    second = LogitProcessors.build([r], EOS, V, torch.device("cpu"))
    assert r.logit_edits is edits
    assert first.allowed_ids.tolist() == second.allowed_ids.tolist() == [3, 17, 40]
    assert first.allowed_rows.tolist() == [1, 1, 1] and second.allowed_rows.tolist() == [0, 0, 0]
    assert first.ban_ids.tolist() == [2, 9] and first.bias_ids.tolist() == [5] and first.bias.tolist() == [1.5]


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one():
    logits = torch.randn(2, V)
    favourite = int(logits[1].argmax())
    reqs = [
        _req(SamplingParams(do_sample=True, logit_bias=((11, 100.0),))),
        _req(SamplingParams(logit_bias=((favourite, -100.0),))),
    ]
    for _ in range(5):
        ids, *_ = _sample(logits, reqs)
        assert ids[0].item() == 11
        assert ids[1].item() != favourite


def test_min_new_tokens_masks_eos_and_stop_ids_until_enough_tokens():
    logits = torch.zeros(1, V)
    p = SamplingParams(min_new_tokens=3, stop_token_ids=(9,), logit_bias=((2, 100.0), (9, 50.0)))
    for before in range(3):  # tokens 0, 1, 2: EOS and the stop id are banned despite their bias
        ids, *_ = _sample(logits, [_req(p, before)])
        assert ids.item() not in (2, 9)
    ids, *_ = _sample(logits, [_req(p, 3)])  # the fourth token may be EOS
    assert ids.item() == 2


def test_min_new_tokens_with_ignore_eos_only_masks_stop_ids():
    logits = torch.zeros(1, V)
    p = SamplingParams(min_new_tokens=2, ignore_eos=True, logit_bias=((2, 100.0),))
    ids, *_ = _sample(logits, [_req(p, 0)])
    assert ids.item() == 2  # EOS does not stop this request, so it is not banned


def test_plain_greedy_batch_has_no_processors():
    sb = SamplingBatch.build([_req(SamplingParams())], V, torch.device("cpu"), EOS)
    assert sb.processors is None and sb.draws.empty  # every row takes its argmax


def test_exponential_decay_length_penalty_matches_hf():
    prompt = (5, 6, 7)
    logits = torch.randn(1, V)
    for generated in (2, 4, 7):
        p = SamplingParams(exponential_decay_length_penalty=(3, 1.5))
        sb = SamplingBatch.build([_req(p, generated, prompt)], V, torch.device("cpu"), EOS)
        ours = sb.processors.apply(logits)
        hf_proc = ExponentialDecayLengthPenalty((3, 1.5), EOS[0], len(prompt))
        hf = hf_proc(torch.zeros(1, len(prompt) + generated, dtype=torch.long), logits.clone())
        assert torch.allclose(ours, hf), generated
        assert (ours[0, 2] > logits[0, 2]).item() == (generated > 3)


def test_input_penalty_counts_prompt_tokens():
    logits = torch.zeros(2, V)
    plain = _req(SamplingParams(presence_penalty=1.0), prompt=(7, 8))
    counted = _req(SamplingParams(presence_penalty=1.0, input_penalty=True), prompt=(7, 8))
    plain.output_ids = counted.output_ids = [9]
    batch = SamplingBatch.build([plain, counted], V, torch.device("cpu"))
    out = apply_penalties(logits, batch.penalties, batch.penalty_tables)
    assert out[0, 7].item() == 0.0 and out[0, 9].item() == -1.0
    assert out[1, 7].item() == -1.0 and out[1, 9].item() == -1.0
