"""The real engine under random load on a tiny cache: requests join at random, some abort, some stop at EOS, long
prompts are split across steps, and (with the prefix cache) many share prefixes of each other's prompts and answers.
It never runs out of KV slots, and the slot count stays exact: the slots in use are always what the running requests
own plus what the prefix tree holds, the two never overlap, and each request's cached prefix is the tree's."""

import random

import numpy as np
import pytest

from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(str(tmp_path_factory.mktemp("admission_llama")))


def _engine(model_dir, prefix_cache: bool):
    return LLM(
        model_dir,
        max_total_token_num=120,
        device="cpu",
        running_max_req_size=64,
        chunked_prefill_size=16,
        prefix_cache=prefix_cache,
    ).engine


def _check_slots(engine) -> None:
    running = engine.scheduler.running
    assert all(len(r.kv_slots) == r.kv_len for r in running)
    own = [s for r in running for s in r.kv_slots[r.cached_len :]]
    tree: list[int] = []
    if engine.prefix is not None:
        tree = [s for node in engine.prefix._nodes() for s in node.slots.tolist()]
        assert len(tree) == engine.prefix.total_tokens
        for r in running:
            assert r.kv_slots[: r.cached_len] == engine.prefix.path_slots(r.prefix_node)
    assert len(set(own + tree)) == len(own) + len(tree), "a slot is owned twice"
    assert engine.kv.slots.num_used == len(own) + len(tree) <= engine.kv.num_slots
    protected = engine.prefix.protected_tokens if engine.prefix is not None else 0
    assert engine.stats().kv_used == len(own) + protected  # unlocked tree slots count as free


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_load_never_runs_out_of_slots(model_dir, seed, prefix_cache):
    engine = _engine(model_dir, prefix_cache)
    rng = random.Random(seed)
    vocab = engine.model_info.vocab_size
    stems = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 25))] for _ in range(4)]
    for step in range(1500):
        if rng.random() < 0.5:
            stem = rng.choice(stems)[: rng.randint(0, 25)] if rng.random() < 0.7 else []
            prompt = stem + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30 - len(stem) // 2))]
            params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5)
            engine.add_request(Request(f"s{seed}-{step}", prompt, params))
        if rng.random() < 0.05 and engine._requests:
            engine.abort(rng.choice(sorted(engine._requests)))
        engine.step()  # raises OutOfSlots if admission ever over-commits
        _check_slots(engine)
    if prefix_cache:
        assert engine.prefix.hit_tokens > 0, "the load shares prefixes: some must have been reused"
    for rid in list(engine._requests):
        engine.abort(rid)
    engine.step()
    assert not engine.has_unfinished()
    if engine.prefix is not None:
        assert engine.prefix.protected_tokens == 0
        assert engine.stats().kv_used == 0 and engine.kv.slots.num_used == engine.prefix.total_tokens
        engine.prefix.clear()
        assert engine.prefix.total_tokens == 0
    assert engine.stats().kv_used == 0 and engine.kv.slots.num_used == 0
    assert np.array_equal(np.sort(engine.kv.slots._stack[: engine.kv.num_slots]), np.arange(engine.kv.num_slots))
