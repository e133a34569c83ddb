"""A tiny random Llama (GQA): our engine's greedy tokens equal HF transformers' generate, token for token."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from tests.models.hf_reference import hf_greedy

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_total_token_num=4096, device="cpu")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 57, 203)]


def test_batched_greedy_equals_hf(llm, hf_model):
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate(prompts, params)
    for prompt, gen in zip(prompts, ours, strict=True):
        assert gen.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert gen.finish_reason == "length"
    assert llm.engine.stats().kv_used == 0


def test_request_joining_mid_decode_equals_hf(llm, hf_model):
    first, late, later = _prompts(hf_model.config.vocab_size)[1:]
    engine = llm.engine
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [Request("join-0", first, params)]
    engine.add_request(reqs[0])
    for step in range(NEW_TOKENS + 20):
        if step == 5:
            reqs.append(Request("join-1", late, params))
            engine.add_request(reqs[-1])
        if step == 11:
            reqs.append(Request("join-2", later, params))
            engine.add_request(reqs[-1])
        engine.step()
    assert all(r.finished for r in reqs)
    for r in reqs:
        assert r.output_ids == hf_greedy(hf_model, r.prompt_ids, NEW_TOKENS)
    assert engine.stats().kv_used == 0


def test_stops_on_eos_like_hf(llm, hf_model):
    """Without ignore_eos both stop at the first EOS; EOS ids come from the checkpoint's configs."""
    prompts = _prompts(hf_model.config.vocab_size)
    eos = llm.engine.model_info.eos_token_ids
    assert eos == (2,)
    for prompt in prompts:
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS, ignore_eos=False)
        ours = llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
        assert ours.token_ids == ref
        assert ours.finish_reason == ("stop" if ref[-1] in eos else "length")


def test_stop_token_ids_and_abort(llm):
    engine = llm.engine
    prompt = _prompts(llm.engine.model_info.vocab_size)[2]
    free_run = llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    stopped = llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=(free_run[3],)))
    assert stopped[0].token_ids == free_run[: free_run.index(free_run[3]) + 1]
    assert stopped[0].finish_reason == "stop"

    req = Request("abort-me", prompt, SamplingParams(max_new_tokens=100, ignore_eos=True))
    engine.add_request(req)
    engine.step()
    engine.step()
    assert engine.stats().kv_used > 0
    engine.abort("abort-me")
    outs = engine.step()
    assert [(o.rid, o.finished, o.finish_reason) for o in outs] == [("abort-me", True, "abort")]
    assert engine.stats().kv_used == 0 and not engine.has_unfinished()


def test_rejects_requests_that_can_never_fit(llm):
    with pytest.raises(ValueError, match="exceeds this server's limit of"):
        llm.engine.add_request(Request("too-long", [1] * 10, SamplingParams(max_new_tokens=10**6)))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.engine.add_request(Request("bad-id", [1, 10**7], SamplingParams()))
