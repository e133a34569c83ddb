"""The router's message handling around a real engine core (tiny random Llama, CPU)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import zmq

from cache.shm_store import ShmEmbedReader, new_prefix
from language.config import EngineConfig
from language.engine import EngineCore
from language.engine_stats import EngineStats
from language.request import RequestError, RequestOutput, length_error
from language.sampling_params import SamplingParams
from mmserve.ipc.messages import AbortRequest, ImageRef, ImagesReady, RouterBatch, TokenizedRequest
from mmserve.ipc.zmq_queue import PullQueue, PushQueue
from mmserve.router import router as router_module
from mmserve.router.router import Router
from mmserve.testing.checkpoints.llama import build_llama

KV_SLOTS = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture
def router(model_dir):
    return Router(EngineCore(EngineConfig(model_dir=model_dir, max_total_token_num=KV_SLOTS, device="cpu")))


def request(rid: str, n: int = 8, prompt_len: int = 5, **kw) -> TokenizedRequest:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return TokenizedRequest(rid, list(range(3, 3 + prompt_len)), params, **kw)


def run_until_idle(router: Router, limit: int = 200) -> list[RouterBatch]:
    batches = []
    for _ in range(limit):
        if not router.has_work():
            return batches
        batch = router.step()
        if batch is not None:
            batches.append(batch)
    raise AssertionError("router did not go idle")


def outputs_of(batches, rid):
    return [o for b in batches for o in b.outputs if o.rid == rid]


def test_setup_precedes_tokens_and_slots_are_freed(router, model_dir):
    router.handle(request("a", n=6))
    batches = run_until_idle(router)
    assert [s.rid for s in batches[0].setups] == ["a"] and batches[0].setups[0].prompt_tokens == 5
    outs = outputs_of(batches, "a")
    assert sum(len(o.new_token_ids) for o in outs) == 6
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].output_tokens == 6
    assert batches[-1].stats.engine.kv_used == 0 and batches[-1].stats.engine.running == 0
    assert batches[-1].stats.engine.kv_total == KV_SLOTS
    assert router.step() is None  # idle and nothing changed: nothing to send


def test_abort_of_a_running_request_frees_its_slots(router):
    router.handle(request("a", n=100))
    first = router.step()
    second = router.step()
    assert second.stats.engine.kv_used > 0 and second.stats.engine.running == 1
    router.handle(AbortRequest("a"))
    assert router.has_work()
    batches = run_until_idle(router)
    final = outputs_of(batches, "a")[-1]
    assert final.finished and final.finish_reason == "abort"
    assert batches[-1].stats.engine.kv_used == 0 and batches[-1].stats.engine.running == 0
    assert first.setups and not router.has_work()
    router.handle(AbortRequest("a"))  # a late duplicate abort is harmless
    assert router.step() is None


def test_requests_wait_for_their_images(router):
    router.handle(request("img", wait_for_images=True))
    batch = router.step()
    assert batch.stats.waiting == 1 and batch.stats.engine.running == 0 and not batch.outputs
    assert not router.core.has_unfinished()
    router.handle(ImagesReady("img"))
    outs = outputs_of(run_until_idle(router), "img")
    assert outs[-1].finished and outs[-1].finish_reason == "length"


def test_images_ready_before_the_request_arrives(router):
    router.handle(ImagesReady("early"))
    router.handle(request("early", wait_for_images=True))
    assert outputs_of(run_until_idle(router), "early")[-1].finish_reason == "length"


def test_failed_images_and_aborted_waiters_finish_without_running(router):
    router.handle(request("bad", wait_for_images=True))
    router.handle(request("gone", wait_for_images=True))
    router.handle(ImagesReady("bad", error="not an image"))
    router.handle(AbortRequest("gone"))
    batches = run_until_idle(router)
    bad, gone = outputs_of(batches, "bad")[-1], outputs_of(batches, "gone")[-1]
    assert bad.finish_reason == "error"
    assert bad.error == RequestError(400, "inputs", "image encoding failed: not an image")
    assert gone.finish_reason == "abort"
    assert batches[-1].stats.waiting == 0 and batches[-1].stats.engine.kv_used == 0


def test_request_that_can_never_fit_is_rejected(router):
    router.handle(request("huge", n=KV_SLOTS, prompt_len=10))
    router.handle(request("fine", n=4))
    batches = run_until_idle(router)
    huge = outputs_of(batches, "huge")
    assert len(huge) == 1 and huge[0].finish_reason == "error"
    limit = router.core.model_info.request_limit
    assert huge[0].error == length_error(10, KV_SLOTS, limit) and huge[0].error.param == "parameters.max_new_tokens"
    assert outputs_of(batches, "fine")[-1].finish_reason == "length"


def test_the_engines_records_cross_the_wire_as_they_are(router):
    """The detokenizer gets the engine's own records (RequestOutput with its RequestError, EngineStats inside the
    router's stats), plain values that unpickle without torch; a refusal names the parameter in its own field."""
    vocab = router.core.model_info.vocab_size
    router.handle(request("ok", n=3))
    refused = dataclasses.replace(request("refused"), params=SamplingParams(logit_bias=((vocab, 1.0),)))
    router.handle(refused)
    batches = run_until_idle(router)
    assert all(type(o) is RequestOutput for b in batches for o in b.outputs)
    assert all(type(b.stats.engine) is EngineStats for b in batches)
    assert outputs_of(batches, "refused")[-1].error == RequestError(
        400, "parameters.logit_bias", f"token ids [{vocab}] are out of the vocabulary (size {vocab})"
    )
    assert outputs_of(batches, "ok")[-1].error is None
    for batch in batches:
        assert b"torch" not in pickle.dumps(batch)


def test_many_requests_never_exceed_the_cache(router):
    # 8 requests of 5 + 40 tokens need 360 slots at peak; the cache has 256: admission must hold some back
    for i in range(8):
        router.handle(request(f"r{i}", n=40))
    batches = run_until_idle(router, limit=2000)
    assert max(b.stats.engine.kv_used for b in batches) <= KV_SLOTS
    assert max(b.stats.waiting for b in batches) > 0
    for i in range(8):
        final = outputs_of(batches, f"r{i}")[-1]
        assert final.finish_reason == "length" and final.output_tokens == 40


def test_an_image_missing_from_the_cache_fails_its_request_alone(router):
    """Defence in depth (issue 34 A3): the embeddings of a request's image are gone when the router takes it (the
    cache entry was evicted): that request fails with an error naming it and the image; the router goes on."""
    router._embed_reader = ShmEmbedReader(new_prefix())  # a cache that holds nothing
    key = "f" * 32
    router.handle(request("lost", images=(ImageRef(key, 1, 2),)))
    router.handle(request("fine", n=3))
    batches = run_until_idle(router)
    (lost,) = outputs_of(batches, "lost")
    assert lost.finish_reason == "error" and lost.error.status == 500 and lost.error.param is None
    assert "request lost" in lost.error.message and key in lost.error.message
    assert outputs_of(batches, "fine")[-1].finish_reason == "length"


def test_unknown_message_type(router):
    with pytest.raises(TypeError):
        router.handle("hello")


class _StepStillRunning:
    """Stands in for the CUDA event of a step still on the device (a CPU engine finishes each step at launch):
    `query()` is False until `finished()` says otherwise."""

    def __init__(self, finished):
        self.finished = finished
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        assert self.queries < 1_000_000, "the router never saw the message that ends the step"
        return self.finished()

    def synchronize(self) -> None:
        assert self.finished()


def test_a_prompt_that_arrives_during_a_long_prompt_step_joins_the_next_step(router, monkeypatch, tmp_path):
    monkeypatch.setattr(router_module, "_PLAN_AFTER_PROMPT_TOKENS", 8)  # "a"'s 10-token prompt is a long step
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/inbox"
    inbox, sender = PullQueue(ctx, addr), PushQueue(ctx, addr)
    try:
        router.handle(request("a", prompt_len=10))
        router.step()  # launches a's prompt
        inflight = router.core._inflight
        assert inflight is not None and inflight.num_prefill_tokens == 10
        # b arrives while a's step runs; the step ends only once the router has taken b in
        inflight.event = _StepStillRunning(lambda: "b" in router._live)
        b = request("b")
        sender.send(dataclasses.replace(b, prompt_ids=list(range(40, 46))))  # shares no prefix with a's prompt
        router._plan_after_long_step(inbox)
        assert "b" in router._live and inflight.event.queries > 1
        router.step()  # collects a's prompt step and launches the next: b's prompt is in it
        assert router.core._inflight.num_prefill_tokens == 6 and router.core._inflight.num_decode == 1
        router._plan_after_long_step(inbox)  # a 6-token step is short: planned while it runs (returns at once)
    finally:
        inbox.close()
        sender.close()
        ctx.term()


def test_under_a_flood_of_prompts_the_next_step_is_planned_while_a_long_one_runs(model_dir, monkeypatch, tmp_path):
    """Prompts already queued fill the next step's prefill budget: waiting for the step in flight would only idle
    the device through the next step's planning, so the router returns at once and plans it overlapped."""
    monkeypatch.setattr(router_module, "_PLAN_AFTER_PROMPT_TOKENS", 8)
    cfg = EngineConfig(model_dir=model_dir, max_total_token_num=KV_SLOTS, device="cpu", chunked_prefill_size=8)
    router = Router(EngineCore(cfg))
    ctx = zmq.Context()
    inbox = PullQueue(ctx, f"ipc://{tmp_path}/inbox")
    try:
        router.handle(request("a", prompt_len=10))
        router.step()  # launches the first 8 of a's 10 prompt tokens: a long step
        inflight = router.core._inflight
        inflight.event = event = _StepStillRunning(lambda: event.queries >= 3)
        router._plan_after_long_step(inbox)  # a's last 2 tokens are queued, less than a step's 8: it waits
        assert event.queries == 3
        inflight.event = _StepStillRunning(lambda: False)
        router.handle(dataclasses.replace(request("b"), prompt_ids=list(range(40, 46))))
        inflight.event = _StepStillRunning(lambda: pytest.fail("waited for the step in flight"))
        router._plan_after_long_step(inbox)  # 2 + 6 queued tokens fill the next step: no wait
        assert inflight.event.queries == 0
    finally:
        inbox.close()
        ctx.term()


def test_tokens_go_out_before_a_prompt_step_is_launched(router):
    router.handle(request("a", n=4))
    first = router.step()  # launches a's prompt
    assert first is not None and [s.rid for s in first.setups] == ["a"] and not first.outputs
    b = request("b")
    router.handle(dataclasses.replace(b, prompt_ids=list(range(40, 46))))

    sent: list[tuple[RouterBatch, object]] = []
    rest = router.step(lambda batch: sent.append((batch, router.core._inflight)))
    # a's first token went out while nothing was in flight: before the step with b's prompt was launched
    ((early, inflight_then),) = sent
    assert inflight_then is None and [o.rid for o in early.outputs] == ["a"] and early.outputs[0].new_token_ids
    assert [s.rid for s in early.setups] == ["b"]  # b's setup precedes any of its tokens
    assert router.core._inflight.num_prefill_tokens == 6 and rest is None  # nothing left: stats unchanged

    sent.clear()
    decode_only = router.step(lambda batch: sent.append((batch, router.core._inflight)))
    assert not sent  # a decode step is launched at once; its predecessor's tokens come back from step()
    assert sorted(o.rid for o in decode_only.outputs) == ["a", "b"]
    batches = run_until_idle(router)
    assert outputs_of(batches, "a")[-1].output_tokens == 4
