"""The HTTP API (FastAPI): /generate, /generate_stream, /health, /metrics, as LightLLM's (and OpenAI's /v1 API,
from openai_api.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from language.request import RequestError
from language.sampling_params import SamplingParams
from mmserve.http.drain import RETRY_AFTER_S
from mmserve.http.engine_client import ClientDisconnected, EngineClient, RequestStream, ServerFailure
from mmserve.http.lightllm_api import add_lightllm_routes
from mmserve.http.metrics import CONTENT_TYPE
from mmserve.http.openai_api import add_openai_routes
from mmserve.http.openai_protocol import OpenAIOptions
from mmserve.http.openapi import HEALTH_ROUTE, METRICS_ROUTE, generate_route
from mmserve.http.protocol import (
    BadRequest,
    error_event,
    generate_group_response,
    generate_response,
    parse_generate_body,
)
from mmserve.http.request_io import (
    collect_streams,
    log_request_timing,
    most_likely,
    read_request_body,
    watch_disconnect,
)
from mmserve.http.slow_clients import ClientTimeouts, ClosingStreamingResponse
from mmserve.http.stream_events import StreamState, stream_events
from mmserve.http.structured import lightllm_field
from mmserve.http.tokenize_api import add_tokenize_routes
from mmserve.ipc.messages import TextOutput

logger = logging.getLogger(__name__)
_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs show what happened


def build_app(
    client: EngineClient, openai: OpenAIOptions | None = None, timeouts: ClientTimeouts | None = None
) -> FastAPI:
    """The routes over one engine client; `openai` carries the server flags the OpenAI routes read. The write
    timeout of `timeouts` is applied around the app (slow_clients.WriteTimeout), its read timeout here."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="mmserve", lifespan=lifespan)
    app.state.client_timeouts = timeouts or ClientTimeouts()
    openai = openai or OpenAIOptions()
    serving = add_openai_routes(app, client, openai)  # /v1/models, /v1/chat/completions, ...
    app.state.openai_serving = serving  # for mmserve.http.first_use
    add_tokenize_routes(app, serving)  # /tokenize, /detokenize, /v1/models/{model}
    add_lightllm_routes(app, client, openai)  # /healthz, /liveness, /readiness, /token_load, ...

    @app.api_route("/health", methods=["GET", "HEAD"], **HEALTH_ROUTE)
    async def health() -> Response:
        # `message` is LightLLM's field ("Ok" / "Error"); `status` and `error` are ours
        if client.healthy():
            reason = client.degraded()  # text is served: still 200, so that a liveness probe keeps the server
            body = {"status": "ok"} if reason is None else {"status": "degraded", "error": reason}
            return JSONResponse({**body, "message": "Ok"})
        error = client.failure or "a child process is down"
        return JSONResponse({"status": "unhealthy", "error": error, "message": "Error"}, 503)

    @app.get("/metrics", **METRICS_ROUTE)
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/generate", **generate_route(stream=False))
    async def generate(request: Request) -> Response:
        streams_or_error = await _submit(client, request, streaming=False)
        if isinstance(streams_or_error, Response):
            return streams_or_error
        streams, params = streams_or_error
        disconnected = watch_disconnect(request)
        try:
            results = await collect_streams(client, streams, disconnected)
        except ServerFailure as e:
            return _server_failure(e)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        for out, _, _ in results:
            if out.error is not None:
                return _error(_refused(out.error, params))
        results = most_likely(results, params.n)  # best_of
        if len(results) == 1:
            out, text, tokens = results[0]
            body = generate_response(
                text,
                tokens,
                out.finish_reason,
                out.prompt_tokens,
                out.output_tokens,
                streams[0].return_details,
                out.cached_tokens,
                out.prompt_logprobs,
                streams[0].image_tokens,
            )
        else:
            body = generate_group_response(results, streams[0].return_details, streams[0].image_tokens)
        return JSONResponse(body)

    @app.post("/generate_stream", **generate_route(stream=True))
    async def generate_stream(request: Request) -> Response:
        streams_or_error = await _submit(client, request, streaming=True)
        if isinstance(streams_or_error, Response):
            return streams_or_error
        (stream,), params = streams_or_error
        disconnected = watch_disconnect(request)
        # Wait for the first piece before answering 200, so that a rejection or a failure that comes before any
        # token still gets its proper status code.
        try:
            first = await stream.next(disconnected)
        except (ServerFailure, ClientDisconnected) as e:
            disconnected.cancel()
            client.abort(stream.rid)
            return _server_failure(e) if isinstance(e, ServerFailure) else Response(status_code=_CLIENT_CLOSED)
        if first.error is not None:
            disconnected.cancel()
            return _error(_refused(first.error, params))
        events = _sse(client, stream, first, params, disconnected)
        return ClosingStreamingResponse(events, media_type="text/event-stream")

    return app


async def _submit(
    client: EngineClient, request: Request, streaming: bool
) -> tuple[list[RequestStream], SamplingParams] | Response:
    """Parse and submit: one stream per sequence (n / best_of fan out into that many engine requests)."""
    try:
        start = time.perf_counter()
        raw = await read_request_body(request)
        read = time.perf_counter()
        body = await client.run_sync(parse_generate_body, raw)  # big bodies: parse off the loop
        parsed = time.perf_counter()
        count = body.params.num_sequences
        if streaming and count > 1:  # as LightLLM's stream API
            name = "best_of" if body.params.best_of not in (None, 1) else "n"
            raise BadRequest(f"parameters.{name}", "/generate_stream returns one sequence: use /generate for n > 1")
        streams = await client.submit_group(body, count)
        log_request_timing(streams[0].rid, len(raw), start, read, parsed)
        return streams, body.params
    except BadRequest as e:
        return _error(e)
    except ServerFailure as e:
        return _server_failure(e)


async def _sse(
    client: EngineClient, stream: RequestStream, first: TextOutput, params: SamplingParams, disconnected: asyncio.Future
) -> AsyncIterator[str]:
    """LightLLM's events (stream_events.py), one per token. Events of outputs that are already queued (the server
    is behind, under load) go out in one write: the same bytes, with the response machinery run once instead of
    once per event. A request the engine ends with an error after its first tokens (its constraint grew too slow
    to match) ends with an error event naming the client's field."""
    state = StreamState(image_tokens=stream.image_tokens)
    events: list[str] = []  # not yet written
    out = first
    try:
        while True:
            if out.error is not None:
                yield "".join(events) + error_event(str(_refused(out.error, params)))
                return
            events += stream_events(out, state)
            if events and (out.finished or not stream.has_queued()):
                yield "".join(events)
                events = []
            if out.finished:
                return
            out = await stream.next(disconnected)
    except ServerFailure as e:
        yield "".join(events) + error_event(str(e))
    except ClientDisconnected:
        return
    finally:
        disconnected.cancel()
        if not stream.finished:
            client.abort(stream.rid)


def _refused(error: RequestError, params: SamplingParams) -> BadRequest:
    """A request the router or the engine refused, named by the client's own parameter."""
    refused = BadRequest.of(error)
    name = lightllm_field(refused.field, params.structured)
    return refused if name == refused.field else BadRequest(name, refused.message, refused.status)


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(e.to_json(), status_code=e.status)


def _server_failure(e: ServerFailure) -> JSONResponse:
    return JSONResponse({"error": f"server failure: {e}"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
