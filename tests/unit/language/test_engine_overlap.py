"""The overlapped engine loop on a real tiny model (CPU): step() launches step N+1 before it reads step N back, so
a request that N finishes runs once more in N+1, whose sample for it is discarded, and never after; its slots all
come back. An abort mid-flight frees exactly its slots. (The prefix cache is off here: with it, an aborted request's
written slots stay in the tree; tests/unit/language/test_prefix_cache.py covers that.)"""

from __future__ import annotations

import numpy as np
import pytest

from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = build_llama(str(tmp_path_factory.mktemp("overlap_llama")))
    return LLM(model_dir, max_total_token_num=512, device="cpu", prefix_cache=False)


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + j) % 50 for j in range(6 + i)]


def test_request_finishing_at_step_n_runs_in_step_n_plus_1_discarded(llm):
    """N+1 is launched before N is read back: the request N stops is in it (a wasted row), its sample there is
    dropped, and no later step holds it."""
    engine = llm.engine
    free_run = llm.generate([_prompt(0)], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    stop = free_run[3]  # the 4th token it samples: make it a stop token
    stopper = Request("stopper", _prompt(0), SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop]))
    others = [Request(f"o{i}", _prompt(i), SamplingParams(max_new_tokens=12, ignore_eos=True)) for i in (1, 2)]
    for r in [stopper, *others]:
        engine.add_request(r)
    finished_in_call = None
    for call in range(40):
        outs = engine.step()
        launched = {id(r) for r, _ in engine._inflight.sampled} if engine._inflight else set()
        if any(o.rid == "stopper" and o.finished for o in outs):
            finished_in_call = call
            assert id(stopper) in launched, "the step after the stopping one was launched after the read-back"
        elif finished_in_call is not None:
            assert id(stopper) not in launched, "the stopped request ran two steps after it finished"
            assert all(o.rid != "stopper" for o in outs), "the wasted row's sample reached the stopped request"
        if not engine.has_unfinished():
            break
    assert finished_in_call is not None
    assert stopper.finish_reason == "stop" and stopper.output_ids == free_run[: free_run.index(stop) + 1]
    assert all(len(r.output_ids) == 12 for r in others)
    assert engine.stats().kv_used == 0


def test_stop_beside_a_penalised_request_frees_every_slot(llm):
    """A request stopped beside a penalised one (whose counts live on the device, its steps overlapped like any)
    gives back every slot and row."""
    engine = llm.engine
    free_run = llm.generate([_prompt(0)], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    stop = free_run[3]
    penalised = SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.2)
    stopper = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    gens = llm.generate([_prompt(0), _prompt(3)], [stopper, penalised])
    assert gens[0].token_ids == free_run[: free_run.index(stop) + 1] and len(gens[1].token_ids) == 8
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.slots.num_used == 0 and engine.kv.num_free_rows() == engine.cfg.running_max_req_size


def _launched_before_read_back(engine, req: Request) -> None:
    """Runs req alone to its end, checking that its first decode step launched before its prompt step was read
    back."""
    engine.add_request(req)
    engine.step()  # the prompt
    engine.step()  # the first decode step, launched before the prompt's step is read back
    assert engine._inflight is not None and engine._inflight.num_decode == 1 and len(req.output_ids) == 1
    while not req.finished:
        engine.step()


def test_seeded_request_draws_the_same_tokens_alone_or_beside_others(llm):
    """A seed needs no read-back (its noise counts the samples staged before): alone, its steps launch before the
    previous one is read back; beside a penalised request it draws the same tokens."""
    seeded = SamplingParams(max_new_tokens=16, ignore_eos=True, do_sample=True, temperature=1.5, seed=11)
    req = Request("seeded", _prompt(2), seeded)
    _launched_before_read_back(llm.engine, req)
    penalised = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    beside = llm.generate([_prompt(2), _prompt(0)], [seeded, penalised])[0].token_ids
    assert req.output_ids == beside and len(set(beside)) > 1


def test_a_penalised_request_launches_before_the_read_back(llm):
    """Its counts live on the device (language/penalties.py), so its steps overlap like any; it answers as when it
    runs beside others, and its row goes back when it finishes."""
    penalised = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=0.5, frequency_penalty=-0.5)
    req = Request("penalised", _prompt(1), penalised)
    _launched_before_read_back(llm.engine, req)
    beside = llm.generate([_prompt(3), _prompt(1)], [SamplingParams(max_new_tokens=9), penalised])[1].token_ids
    assert req.output_ids == beside and len(set(beside)) < len(beside)  # the penalty below 1 makes it repeat
    assert llm.engine.runner.penalties.rows_held == 0


def test_abort_while_a_step_is_in_flight_frees_exactly_its_slots(llm):
    engine = llm.engine
    reqs = [Request(f"a{i}", _prompt(i), SamplingParams(max_new_tokens=30, ignore_eos=True)) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    victim = reqs[1]
    assert engine._inflight is not None and any(r is victim for r, _ in engine._inflight.sampled)
    held = list(victim.kv_slots)  # includes the slot the in-flight step writes
    assert len(held) == victim.kv_len > victim.seq_len - 1
    used_before = engine.stats().kv_used
    engine.abort(victim.rid)
    assert engine.stats().kv_used == used_before - len(held)
    assert not engine.kv.slots._used[np.array(held)].any()
    outs = engine.step()  # reads the in-flight step back: the victim's sample is dropped
    assert [o.finish_reason for o in outs if o.rid == victim.rid] == ["abort"]
    assert engine.stats().kv_used == sum(r.kv_len for r in engine.scheduler.running)
    while engine.has_unfinished():
        assert all(o.rid != victim.rid for o in engine.step())
    assert engine.stats().kv_used == 0 and engine.kv.num_free_rows() == engine.cfg.running_max_req_size
    assert all(len(r.output_ids) == 30 for r in (reqs[0], reqs[2]))


def test_greedy_fast_path_equals_the_general_sampler(llm):
    """Greedy requests alone take the argmax fast path; beside a sampling request the whole batch goes through the
    general sampler. Both give the same ids and log-probabilities."""
    prompts = [_prompt(i) for i in range(3)]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    fast = llm.generate(prompts, greedy)
    sampler = SamplingParams(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=0.8, top_p=0.9)
    general = llm.generate(prompts + [_prompt(5)], [greedy] * 3 + [sampler])
    for a, b in zip(fast, general, strict=False):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
