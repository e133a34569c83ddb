"""/generate_stream's event generator: outputs already queued leave in one write, with exactly the bytes they would
have had one by one; an output that arrives later gets a write of its own; an error the engine ends a request with
after its first tokens is the last event, naming the client's field."""

from __future__ import annotations

import asyncio
import json

from language.request import RequestError
from language.sampling_params import SamplingParams, StructuredOutput
from mmserve.http.engine_client import RequestStream, ServerFailure
from mmserve.http.server import _sse
from mmserve.ipc.messages import TextOutput, TokenDetail

PLAIN = SamplingParams()


def _out(i: int, finished: bool = False) -> TextOutput:
    return TextOutput("r", f"t{i}", [TokenDetail(i, f"t{i}", -0.5)], finished, "length" if finished else None, 3, i + 1)


def _events(chunk: str) -> list[dict]:
    return [json.loads(e.removeprefix("data:")) for e in chunk.split("\n\n") if e]


async def _writes(
    stream: RequestStream, first: TextOutput, later: list[TextOutput | ServerFailure], params=PLAIN
) -> list[str]:
    disconnected = asyncio.get_running_loop().create_future()
    writes = []
    async for chunk in _sse(None, stream, first, params, disconnected):
        writes.append(chunk)
        if later:  # the next output arrives only after this write
            stream.queue.put_nowait(later.pop(0))
    return writes


def test_queued_outputs_leave_in_one_write():
    stream = RequestStream("r", return_details=False)
    for i in range(1, 4):
        stream.queue.put_nowait(_out(i, finished=i == 3))
    writes = asyncio.run(_writes(stream, _out(0), []))
    assert len(writes) == 1
    events = _events(writes[0])
    assert [e["token"]["text"] for e in events] == ["t0", "t1", "t2", "t3"]
    assert events[-1]["finished"] and events[-1]["generated_text"] == "t0t1t2t3"


def test_outputs_that_arrive_one_by_one_are_written_one_by_one():
    stream = RequestStream("r", return_details=False)
    writes = asyncio.run(_writes(stream, _out(0), [_out(1), _out(2, finished=True)]))
    assert [[e["token"]["text"] for e in _events(w)] for w in writes] == [["t0"], ["t1"], ["t2"]]


def test_an_error_after_the_first_tokens_ends_the_stream_naming_the_field():
    stream = RequestStream("r", return_details=False)
    error = RequestError.refused("parameters.structured", "the constraint grew too slow to match")
    ended = TextOutput("r", "", [], True, "error", 3, 2, error)
    params = SamplingParams(structured=StructuredOutput("regex", "a+"))  # LightLLM's regular_constraint
    writes = asyncio.run(_writes(stream, _out(0), [_out(1), ended], params))
    events = [e for w in writes for e in _events(w)]
    assert [e["token"]["text"] for e in events[:2]] == ["t0", "t1"]
    assert events[-1] == {
        "error": "parameters.regular_constraint: the constraint grew too slow to match",
        "finished": True,
        "finish_reason": "error",
    }
