"""The real engine under random load on a tiny cache: requests join at random, some abort, some stop at EOS, long
prompts are split across steps; it never runs out of KV slots, and the slots it holds always equal what its running
requests have stored (or are storing in the step in flight)."""

import random

import pytest

from language.llm import LLM
from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.checkpoints.llama import build_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_llama(str(tmp_path_factory.mktemp("admission_llama")))
    return LLM(
        model_dir, max_total_token_num=120, device="cpu", running_max_req_size=64, chunked_prefill_size=16
    ).engine


@pytest.mark.parametrize("seed", [0, 1])
def test_random_load_never_runs_out_of_slots(engine, seed):
    rng = random.Random(seed)
    vocab = engine.model_info.vocab_size
    for step in range(1500):
        if rng.random() < 0.5:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5)
            engine.add_request(Request(f"s{seed}-{step}", prompt, params))
        if rng.random() < 0.05 and engine._requests:
            engine.abort(rng.choice(sorted(engine._requests)))
        engine.step()  # raises OutOfSlots if admission ever over-commits
        stored = sum(r.kv_len for r in engine.scheduler.running)
        assert all(len(r.kv_slots) == r.kv_len for r in engine.scheduler.running)
        assert engine.stats().kv_used == stored <= engine.stats().kv_total
    for rid in list(engine._requests):
        engine.abort(rid)
    engine.step()
    assert engine.stats().kv_used == 0 and not engine.has_unfinished()
