"""What the HTTP process's EngineClient holds for a request (through the preparer: its images' cache entries) and
when it lets go: exactly once, when the request's prefill has run or the router reports it ended — also when its
client left before (the router may not have read it yet), never at the abort itself. n / best_of: one
tokenization fans out into sub-requests <rid>-i (seed + i), released when the last member ends."""

from __future__ import annotations

import asyncio

import pytest

from language.sampling_params import SamplingParams
from mmserve.http.engine_client import EngineClient
from mmserve.http.metrics import ServerMetrics
from mmserve.http.protocol import GenerateInput
from mmserve.ipc.messages import AbortRequest, DetokBatch, TextOutput, TokenizedRequest


class FakePreparer:
    def __init__(self):
        self.prepared: list[str] = []
        self.released: list[str] = []

    async def prepare(self, rid, req, run_sync) -> TokenizedRequest:
        self.prepared.append(rid)
        return TokenizedRequest(rid, [1, 2, 3], req.params)

    def release(self, rid: str) -> None:
        self.released.append(rid)


class Outbox(list):
    def send_nowait(self, msg) -> None:
        self.append(msg)


def make_client() -> tuple[EngineClient, FakePreparer, Outbox]:
    preparer = FakePreparer()
    client = EngineClient(preparer, [], None, ServerMetrics(), tokenizer_workers=2)
    client._to_router = Outbox()
    client._failed = asyncio.Event()
    return client, preparer, client._to_router


def finished(rid: str, reason: str = "length") -> TextOutput:
    return TextOutput(rid, "x", [], True, reason, 3, 1)


def first_token(rid: str) -> TextOutput:
    return TextOutput(rid, "x", [], False, None, 3, 1)


def test_group_members_share_one_tokenization_and_release_once():
    async def go():
        client, preparer, sent = make_client()
        params = SamplingParams(do_sample=True, seed=5, n=3).validate()
        streams = await client.submit_group(GenerateInput("hi", params), 3)
        (rid,) = preparer.prepared
        assert [s.rid for s in streams] == [f"{rid}-{i}" for i in range(3)] == [m.rid for m in sent]
        assert [m.params.seed for m in sent] == [5, 6, 7]
        client._deliver(DetokBatch([finished(f"{rid}-0")]))
        client.abort(f"{rid}-1")
        assert preparer.released == [] and client.num_groups == 1
        assert sent[-1] == AbortRequest(f"{rid}-1")
        client._deliver(DetokBatch([finished(f"{rid}-2")]))
        assert preparer.released == [] and client.num_in_flight == 0  # the router has not dropped -1 yet
        client._deliver(DetokBatch([finished(f"{rid}-1", "abort")]))
        assert preparer.released == [rid] and client.num_groups == 0 and client.num_abandoned == 0
        client.abort(f"{rid}-2")  # late: nothing more happens
        assert preparer.released == [rid]

    asyncio.run(go())


def test_failure_releases_groups_and_single_requests():
    async def go():
        client, preparer, _ = make_client()
        single = await client.submit(GenerateInput("a", SamplingParams()))
        group = await client.submit_group(GenerateInput("b", SamplingParams(n=2).validate()), 2)
        client._fail_all("boom")
        gid = group[0].rid.rsplit("-", 1)[0]
        assert sorted(preparer.released) == sorted([single.rid, gid])
        assert client.num_groups == 0 and client.num_in_flight == 0

    asyncio.run(go())


def test_an_aborted_request_holds_its_images_until_the_router_dropped_it():
    """Issue 34 A3: the router reads a request's embeddings when it takes it from its inbox, which may be after the
    client left; released at the abort, they could be evicted before."""

    async def go():
        client, preparer, sent = make_client()
        stream = await client.submit(GenerateInput("a", SamplingParams()))
        client.abort(stream.rid)
        assert sent[-1] == AbortRequest(stream.rid)
        assert preparer.released == [] and client.num_abandoned == 1 and client.num_in_flight == 0
        client._deliver(DetokBatch([finished(stream.rid, "abort")]))
        assert preparer.released == [stream.rid] and client.num_abandoned == 0
        client._deliver(DetokBatch([finished(stream.rid, "abort")]))  # a duplicate changes nothing
        assert preparer.released == [stream.rid]

    asyncio.run(go())


def test_a_request_aborted_after_its_prefill_ran_is_released_once():
    async def go():
        client, preparer, _ = make_client()
        stream = await client.submit(GenerateInput("a", SamplingParams()))
        client._deliver(DetokBatch([first_token(stream.rid)]))
        assert preparer.released == [stream.rid]  # its prefill ran: nothing reads its images any more
        client.abort(stream.rid)
        client._deliver(DetokBatch([finished(stream.rid, "abort")]))
        assert preparer.released == [stream.rid] and client.num_abandoned == 0

    asyncio.run(go())


def test_abandoned_requests_are_released_when_the_router_is_gone():
    async def go():
        client, preparer, _ = make_client()
        stream = await client.submit(GenerateInput("a", SamplingParams()))
        client.abort(stream.rid)
        client._fail_all("the router process exited")
        assert preparer.released == [stream.rid] and client.num_abandoned == 0

    asyncio.run(go())


class GatedPreparer(FakePreparer):
    """A preparer whose prepare holds something from its start and waits for `gate` (an image being encoded)."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.held: set[str] = set()

    async def prepare(self, rid, req, run_sync) -> TokenizedRequest:
        self.held.add(rid)
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.held.discard(rid)
            raise
        return await super().prepare(rid, req, run_sync)

    def release(self, rid: str) -> None:
        super().release(rid)
        self.held.discard(rid)


@pytest.mark.parametrize("encoded_meanwhile", [False, True])
def test_a_submit_cancelled_while_its_images_encode_holds_nothing(encoded_meanwhile):
    async def go():
        client, _, sent = make_client()
        preparer = client.preparer = GatedPreparer()
        task = asyncio.ensure_future(client.submit(GenerateInput("a", SamplingParams())))
        while not preparer.held:
            await asyncio.sleep(0)
        if encoded_meanwhile:  # prepare finishes in the same turn of the loop as the cancel comes
            preparer.gate.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(5):  # let a prepare that was cancelled unwind
            await asyncio.sleep(0)
        assert preparer.held == set() and not sent and client.num_in_flight == 0

    asyncio.run(go())
