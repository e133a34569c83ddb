"""The vision tower's turn on the shared GPU (visual/tower_turn.py): the flag the visual process raises while a batch
runs, as the router reads it, and the router holding back decode-only steps while it is up (real engine core on
CPU, real zmq inbox)."""

from __future__ import annotations

import pickle
import time

import pytest
import zmq

from language.config import EngineConfig
from language.engine import EngineCore
from language.sampling_params import SamplingParams
from mmserve.ipc.messages import TokenizedRequest
from mmserve.ipc.zmq_queue import PullQueue, PushQueue
from mmserve.router.router import Router
from mmserve.testing.checkpoints.llama import build_llama
from visual import tower_turn
from visual.shm_segments import list_segments, new_prefix, unlink_all
from visual.tower_turn import TowerTurn


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


@pytest.fixture
def reopen_at_once(monkeypatch):
    monkeypatch.setattr(tower_turn, "_REOPEN_S", 0.0)


def test_reader_sees_the_writers_flag(prefix, reopen_at_once):
    reader = pickle.loads(pickle.dumps(TowerTurn(prefix)))  # as the router gets it: only the name travels
    assert not reader.is_up()  # no visual process yet: nothing to wait for
    writer = TowerTurn(prefix)
    writer.create()
    assert list_segments(prefix) == [prefix + "tower_turn"]  # swept with the embeddings at stop
    assert not reader.is_up()
    with writer.batch_running():
        assert reader.is_up()
    assert not reader.is_up()
    with pytest.raises(RuntimeError), writer.batch_running():  # a batch that fails lowers it too
        raise RuntimeError("the tower failed")
    assert not reader.is_up()


def test_a_flag_left_by_a_dead_visual_process_expires_and_its_successor_is_seen(prefix, reopen_at_once, monkeypatch):
    reader, dead = TowerTurn(prefix), TowerTurn(prefix)
    dead.create()
    dead.raise_flag()  # and then the process died mid-batch
    assert reader.is_up()
    monkeypatch.setattr(tower_turn, "_STALE_S", 0.05)
    time.sleep(0.1)
    assert not reader.is_up()  # older than any batch runs: ignored
    successor = TowerTurn(prefix)
    successor.create()  # replaces the segment: the reader maps the new one
    assert not reader.is_up()
    successor.raise_flag()
    assert reader.is_up()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(str(tmp_path_factory.mktemp("llama")))


def _router(model_dir: str, turn: TowerTurn, hold_s: float) -> Router:
    core = EngineCore(EngineConfig(model_dir=model_dir, max_total_token_num=256, device="cpu"))
    return Router(core, None, turn, hold_s)


def _request(rid: str, prompt_len: int = 5) -> TokenizedRequest:
    return TokenizedRequest(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=50, ignore_eos=True))


def _held_s(router: Router, inbox: PullQueue) -> float:
    t0 = time.perf_counter()
    router._give_tower_its_turn(inbox)
    return time.perf_counter() - t0


def test_decode_only_steps_wait_for_the_tower_and_prompts_do_not(model_dir, prefix, reopen_at_once):
    writer, reader = TowerTurn(prefix), TowerTurn(prefix)
    writer.create()
    router = _router(model_dir, reader, hold_s=0.3)
    ctx = zmq.Context()
    addr = f"ipc:///tmp/{prefix}inbox"
    inbox, sender = PullQueue(ctx, addr), PushQueue(ctx, addr)
    try:
        router.handle(_request("a"))
        writer.raise_flag()
        assert _held_s(router, inbox) < 0.05  # "a" waits to be prefilled: its prompt goes first
        while router.core.has_prompt_work():
            router.step()
        router.step()  # "a" decodes now
        held = _held_s(router, inbox)
        assert 0.25 < held < 1.0  # the tower's turn, up to the limit
        assert router.core.counters.tower_waits == 1
        writer.lower_flag()
        assert _held_s(router, inbox) < 0.05  # no batch in the tower: no wait
        writer.raise_flag()
        sender.send(_request("b"))  # a new prompt arrives while the step is held: the wait ends for it
        assert _held_s(router, inbox) < 0.25
        assert router.core.has_prompt_work()
    finally:
        inbox.close()
        sender.close()
        ctx.term()


def test_without_a_turn_nothing_waits(model_dir, prefix):
    writer = TowerTurn(prefix)
    writer.create()
    writer.raise_flag()
    router = _router(model_dir, TowerTurn(prefix), hold_s=0.0)  # --tower_turn_ms 0
    router.handle(_request("a"))
    for _ in range(3):
        router.step()
    assert not router.core.has_prompt_work()
    assert _held_s(router, None) < 0.01  # never reads the inbox either


def test_the_visual_process_reads_the_routers_backlog_while_it_is_fresh(prefix, reopen_at_once, monkeypatch):
    visual, router_side = TowerTurn(prefix), pickle.loads(pickle.dumps(TowerTurn(prefix)))
    router_side.publish_backlog(9000)  # no segment yet (the visual process starts later): nothing written, no error
    visual.create()
    assert visual.prompt_backlog() == 0  # never written: holds nothing back
    router_side.publish_backlog(9000)
    assert visual.prompt_backlog() == 9000
    router_side.publish_backlog(0)
    assert visual.prompt_backlog() == 0
    router_side.publish_backlog(5000)
    monkeypatch.setattr(tower_turn, "_BACKLOG_STALE_S", 0.05)
    time.sleep(0.1)
    assert visual.prompt_backlog() == 0  # a router that stopped writing holds nothing back


def test_the_router_publishes_its_prompt_backlog_up_to_the_lookahead(model_dir, prefix, reopen_at_once):
    visual = TowerTurn(prefix)
    visual.create()
    core = EngineCore(EngineConfig(model_dir=model_dir, max_total_token_num=256, device="cpu", chunked_prefill_size=8))
    router = Router(core, None, TowerTurn(prefix), 0.0, tower_lookahead_tokens=12)
    for rid in "ab":
        router.handle(_request(rid, prompt_len=10))  # 20 prompt tokens, prefilled 8 a step
    seen = []
    while router.core.has_unfinished() and len(seen) < 10:
        router.publish_backlog()
        seen.append(visual.prompt_backlog())
        router.step()
    assert seen[:4] == [12, 12, 4, 0]  # counted up to the lookahead only; then 20 - 8 - 8 left; then none
    assert TowerTurn(prefix).prompt_backlog() == 0  # (a reader that never mapped the segment reads nothing)


def test_without_a_lookahead_the_router_publishes_nothing(model_dir, prefix, reopen_at_once):
    visual = TowerTurn(prefix)
    visual.create()
    router = _router(model_dir, TowerTurn(prefix), hold_s=0.0)  # --tower_lookahead_tokens 0
    router.handle(_request("a", prompt_len=10))
    router.publish_backlog()
    assert visual.prompt_backlog() == 0
