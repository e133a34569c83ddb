"""One bad request fails alone (tiny random Llama, real engine and router on CPU): parameters the engine's dtypes
cannot hold are refused at admission, the EOS length boost stays finite however long a request runs, an image whose
embeddings cannot be read is refused by the router, and a step that raises fails the requests it held, returns
their KV slots, and the engine serves the next request as before."""

from __future__ import annotations

import math

import pytest
import torch

from cache.shm_store import ShmEmbedReader
from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.ipc.messages import ImageRef, TokenizedRequest
from mmserve.llm import LLM
from mmserve.router.router import Router
from mmserve.testing.checkpoints.llama import build_llama

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = build_llama(str(tmp_path_factory.mktemp("failures_llama")))
    return LLM(model_dir, max_total_token_num=1024, device="cpu")


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + j) % 50 for j in range(6)]


def _alone(llm, prompt: list[int]) -> list[int]:
    (gen,) = llm.generate([prompt], GREEDY)
    return gen.token_ids


def _idle(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv.slots.num_used == (engine.prefix.total_tokens if engine.prefix else 0)


def test_a_top_k_beyond_int64_is_refused_at_admission(llm):
    """Built directly (no HTTP validation): the engine refuses it in add_request, not in a later step."""
    expected = _alone(llm, _prompt(1))
    good = Request("good", _prompt(1), GREEDY)
    llm.engine.add_request(good)
    bad = Request("bad", _prompt(2), SamplingParams(do_sample=True, top_k=2**64, max_new_tokens=4))
    with pytest.raises(ValueError, match="top_k"):
        llm.engine.add_request(bad)
    while not good.finished:
        llm.engine.step()
    assert good.output_ids == expected
    _idle(llm)


def test_the_eos_boost_stays_finite_at_any_length(llm):
    """decay_factor 10 passes 1e308 after 309 tokens (a Python OverflowError before); the boost is capped, the
    logits stay finite and a plain request beside it is unchanged."""
    expected = _alone(llm, _prompt(3))
    params = SamplingParams(max_new_tokens=320, ignore_eos=True, exponential_decay_length_penalty=(0, 10.0))
    boosted, plain = llm.generate([_prompt(4), _prompt(3)], [params, GREEDY])
    assert len(boosted.token_ids) == 320 and all(math.isfinite(lp) for lp in boosted.logprobs)
    assert boosted.token_ids[-1] in llm.engine.model_info.eos_token_ids  # EOS wins, ignore_eos keeps it going
    assert plain.token_ids == expected
    _idle(llm)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(llm):
    """A request built directly with M-RoPE positions ([3, L]) for a model whose rotary has one axis passes
    admission and breaks the step that stages its prompt. The requests the engine holds end with an error, every
    KV slot comes back, and the next request runs as it would on a fresh engine."""
    engine = llm.engine
    expected = _alone(llm, _prompt(5))
    running = Request("running", _prompt(6), SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.add_request(running)
    outputs = []
    for _ in range(3):
        outputs += engine.step()
    assert running.output_ids and not running.finished
    broken = Request("broken", _prompt(7), GREEDY, positions=torch.zeros((3, 6), dtype=torch.int64))
    engine.add_request(broken)
    for _ in range(3):
        outputs += engine.step()
    failed = {o.rid: o for o in outputs if o.finish_reason == "error"}
    assert set(failed) == {"running", "broken"}
    assert all(o.finished and o.error.status == 500 and o.error.param is None for o in failed.values())
    assert all(o.error.message.startswith("the step that ran this request raised") for o in failed.values())
    assert running.finished and broken.finished
    _idle(llm)
    assert _alone(llm, _prompt(5)) == expected
    _idle(llm)


def test_an_image_that_cannot_be_read_is_refused_alone(llm):
    """The router reads an image's embeddings when it admits the request; a segment that is gone fails that
    request with an error, and the router goes on serving the others."""
    router = Router(llm.engine, ShmEmbedReader("mmsv_test_no_such_prefix"))
    expected = _alone(llm, _prompt(8))
    image = ImageRef("no-such-key", offset=2, num_tokens=2)
    router.handle(TokenizedRequest("img", _prompt(9), GREEDY, images=(image,)))
    router.handle(TokenizedRequest("text", _prompt(8), GREEDY))
    outputs = []
    for _ in range(50):
        if not router.has_work():
            break
        batch = router.step()
        outputs += batch.outputs if batch is not None else []
    (refused,) = [o for o in outputs if o.rid == "img"]
    assert refused.finish_reason == "error" and refused.error.status == 500 and "no-such-key" in refused.error.message
    assert [t for o in outputs if o.rid == "text" for t in o.new_token_ids] == expected
    _idle(llm)
