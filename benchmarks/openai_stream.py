"""One streamed request through the OpenAI chat API (/v1/chat/completions), as vLLM and mmserve both serve it, read
into the `RequestResult` that LightLLM's /generate_stream gives (benchmarks/bench_stats.py), so the two APIs'
figures mean the same.

Events are the content-bearing chunks (a delta with non-empty text), each with its cumulative token count when the
chunk carries usage (`stream_options.continuous_usage_stats`, which both servers honour); the token total and prompt
length come from the final usage chunk (`include_usage`). TTFT is the first content-bearing chunk: tokens that
decode to no text send none in either server. Both servers also send a first chunk holding only the assistant role
once the first token is out; its arrival is kept (`first_chunk`), and stands in for TTFT in a request whose tokens
all decoded to no text (`no_text`)."""

from __future__ import annotations

import httpx

from benchmarks.bench_stats import RequestResult
from benchmarks.sse_stream import stream_request


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model /v1/models lists: the name a request's "model" must carry (vLLM's serve.sh serves "model",
    mmserve its checkpoint folder's name or --served_model_name)."""
    resp = httpx.get(url + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def usage_counts(chunk: dict) -> tuple[int | None, int | None]:
    """(completion tokens so far, prompt tokens) of a chunk's usage, or Nones without one."""
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None, None
    return usage.get("completion_tokens"), usage.get("prompt_tokens")


def read_chunk(r: RequestResult, chunk: dict, now: float) -> bool:
    """Fold one parsed chunk into `r`; True once the choice has finished (its finish_reason came)."""
    count, prompt_tokens = usage_counts(chunk)
    if prompt_tokens is not None:
        r.prompt_tokens = prompt_tokens
    choices = chunk.get("choices") or []
    if not choices:  # the final usage chunk: the total
        if count is not None:
            r.tokens = count
        return False
    if r.first_chunk is None:
        r.first_chunk = now
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content")
    if isinstance(text, str) and text:
        r.events.append((now, count))
        r.text += text
    if count is not None:
        r.tokens = count
    return choice.get("finish_reason") is not None


async def one_openai_request(client: httpx.AsyncClient, url: str, body: bytes) -> RequestResult:
    finished = False

    def read_event(r: RequestResult, chunk: dict, now: float) -> None:
        nonlocal finished
        finished = read_chunk(r, chunk, now) or finished

    r = await stream_request(client, url + "/v1/chat/completions", body, read_event)
    if r.error is None and not (finished and r.tokens):
        r.error = "stream ended without a finish_reason and a token count"
    if r.error is None and not r.events and r.first_chunk is not None:
        r.events.append((r.first_chunk, None))  # no token decoded to text: time the first chunk
        r.no_text = True
    return r
