"""n / best_of in the HTTP process: one tokenization fans out into sub-requests <rid>-i (seed + i), and what the
preparer holds for it is released exactly once, when the last member ends — finished, aborted or failed."""

from __future__ import annotations

import asyncio

from language.sampling_params import SamplingParams
from mmserve.engine_client import EngineClient
from mmserve.messages import AbortRequest, DetokBatch, TextOutput, TokenizedRequest
from mmserve.metrics import ServerMetrics
from mmserve.protocol import GenerateInput


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


def finished(rid: str) -> TextOutput:
    return TextOutput(rid, "x", [], True, "length", 3, 1)


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
        assert preparer.released == [rid] and client.num_groups == 0 and client.num_in_flight == 0
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
