"""The engine (overlapped steps, tiny random Llama on CPU) with min_new_tokens, allowed_token_ids, logit_bias and
the EOS length boost: each has its effect, and plain greedy requests batched beside them are unchanged."""

from __future__ import annotations

import pytest

from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = build_llama(str(tmp_path_factory.mktemp("params_llama")))
    return LLM(model_dir, max_total_token_num=1024, device="cpu")


@pytest.fixture(scope="module")
def eos(llm) -> int:
    return llm.engine.model_info.eos_token_ids[0]


def _prompt(i: int) -> list[int]:
    return [3 + (11 * i + j) % 60 for j in range(5 + i)]


def test_min_new_tokens_holds_back_a_forced_eos(llm, eos):
    forced = {"logit_bias": ((eos, 100.0),), "max_new_tokens": 12}
    params = [SamplingParams(min_new_tokens=least, **forced) for least in (0, 4, 9)]
    early, held, longer = llm.generate([_prompt(0), _prompt(1), _prompt(2)], params)
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    for gen, least in ((held, 4), (longer, 9)):
        assert len(gen.token_ids) == least + 1, gen.token_ids  # never stops early, stops as soon as allowed
        assert eos not in gen.token_ids[:least] and gen.token_ids[-1] == eos and gen.finish_reason == "stop"
    assert llm.engine.stats().kv_used == 0


def test_min_new_tokens_masks_stop_token_ids_too(llm):
    stop = 40
    p = SamplingParams(min_new_tokens=3, max_new_tokens=8, stop_token_ids=(stop,), logit_bias=((stop, 100.0),))
    (gen,) = llm.generate([_prompt(3)], p)
    assert gen.token_ids[:3].count(stop) == 0 and gen.token_ids[3] == stop and len(gen.token_ids) == 4


def test_allowed_token_ids_and_logit_bias_beside_plain_greedy(llm):
    plain = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = [g.token_ids for g in llm.generate([_prompt(4), _prompt(5)], plain)]
    allowed = (7, 19, 23, 42)
    params = [
        plain,
        SamplingParams(do_sample=True, temperature=1.5, max_new_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias=((33, 100.0),)),
        plain,
    ]
    gens = llm.generate([_prompt(4), _prompt(6), _prompt(7), _prompt(5)], params)
    assert gens[0].token_ids == alone[0] and gens[3].token_ids == alone[1]  # plain rows keep their greedy output
    assert len(gens[1].token_ids) == 10 and set(gens[1].token_ids) <= set(allowed)
    assert gens[2].token_ids == [33] * 10


def test_exponential_decay_length_penalty_ends_generation(llm, eos):
    base = {"max_new_tokens": 40, "logit_bias": ((eos, -8.0),)}
    (free,) = llm.generate([_prompt(8)], SamplingParams(**base))
    (decayed,) = llm.generate([_prompt(8)], SamplingParams(exponential_decay_length_penalty=(2, 8.0), **base))
    assert free.finish_reason == "length"
    assert decayed.finish_reason == "stop" and len(decayed.token_ids) < 40 and decayed.token_ids[-1] == eos


def test_out_of_vocabulary_ids_are_refused(llm):
    vocab = llm.engine.model_info.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([_prompt(0)], SamplingParams(allowed_token_ids=(vocab,)))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([_prompt(0)], SamplingParams(logit_bias=((vocab + 5, 1.0),)))
    eos = llm.engine.model_info.eos_token_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids"):  # nothing would be left to sample
        llm.generate([_prompt(0)], SamplingParams(allowed_token_ids=(eos,), min_new_tokens=2))
