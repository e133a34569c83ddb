"""The OpenAI-compatible API, as vLLM shapes it: GET /v1/models, POST /v1/chat/completions and POST /v1/completions
(streaming or not). Each request becomes the server's own GenerateInput (`openai_protocol.py`) and goes through the
same engine client as /generate: tokenization, image checks and fetch rules, the embedding cache, the detokenizer
and its stop handling. Errors come in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mmserve.chat_templates import builtin_chat_template, model_architecture
from mmserve.engine_client import ClientDisconnected, EngineClient, RequestStream, ServerFailure
from mmserve.http_server import _read_body, _watch_disconnect
from mmserve.messages import TextOutput
from mmserve.openai_protocol import (
    OpenAIOptions,
    chat_input,
    completion_input,
    find_chat_template,
    include_usage,
)
from mmserve.protocol import BadRequest, GenerateInput, parse_json

_CLIENT_CLOSED = 499


def openai_error(message: str, status: int = 400, param: str | None = None, kind: str | None = None) -> JSONResponse:
    if kind is None:
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _bad_request(e: BadRequest, prompt_field: str) -> JSONResponse:
    """The shared pipeline's field names (/generate's) -> the OpenAI request's."""
    param = e.field
    if param == "inputs" or param.startswith("multimodal_params"):
        param = prompt_field
    elif param == "parameters.max_new_tokens":
        param = "max_tokens"
    elif param.startswith("parameters."):
        param = param.removeprefix("parameters.")
    message = f"{param}: {e.message}"
    if e.field.startswith("multimodal_params"):
        message = f"{e.field.replace('multimodal_params.images', 'image')}: {e.message}"
    return openai_error(message, e.status, param)


class OpenAIServing:
    def __init__(self, client: EngineClient, options: OpenAIOptions):
        self.client = client
        self.tokenizer = client.preparer.tokenizer
        self.model_dir = getattr(self.tokenizer, "name_or_path", None) or ""
        folder_name = os.path.basename(os.path.normpath(self.model_dir)) if self.model_dir else "mmserve"
        self.model_name = options.served_model_name or folder_name
        if options.chat_template is not None:  # --chat_template overrides the checkpoint's own
            with open(options.chat_template) as f:
                self.template = f.read()
        else:
            # the checkpoint's own, else the family's built-in (chat_templates.py)
            self.template = find_chat_template(self.tokenizer, self.model_dir) or builtin_chat_template(
                model_architecture(self.model_dir)
            )
        self.created = int(time.time())
        self.image_dir = options.image_dir

    @property
    def max_len(self) -> int:
        return self.client.preparer.limits.max_req_total_len

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mmserve",
                "root": self.model_dir, "parent": None, "max_model_len": self.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def submit(self, request: Request, parse: Callable[[dict, int], GenerateInput], prompt_field: str):
        """-> (body, RequestStream) or an error response. A chat with no max_tokens may fill the context, as vLLM's
        (`fill_context`: the preparer sizes it once the prompt is tokenized)."""
        try:
            body = parse_json(await _read_body(request))
            include_usage(body)  # checked before anything is submitted
            model = body.get("model")
            if model is not None and model != self.model_name:
                return openai_error(f"The model `{model}` does not exist.", 404, "model")
            req = await self.client.run_sync(parse, body, self.max_len)
            return body, await self.client.submit(req)
        except BadRequest as e:
            return _bad_request(e, prompt_field)
        except ServerFailure as e:
            return openai_error(f"server failure: {e}", 503)

    def _parse_chat(self, body: dict, default_max: int) -> GenerateInput:
        return chat_input(body, self.tokenizer, self.template, self.image_dir, default_max)

    async def respond(self, request: Request, kind: str) -> Response:
        chat = kind == "chat"
        parse = self._parse_chat if chat else completion_input
        result = await self.submit(request, parse, "messages" if chat else "prompt")
        if isinstance(result, Response):
            return result
        body, stream = result
        rid = ("chatcmpl-" if chat else "cmpl-") + stream.rid
        disconnected = _watch_disconnect(request)
        if body.get("stream"):
            return await self._start_stream(request, body, stream, rid, chat, disconnected)
        pieces: list[str] = []
        try:
            while True:
                out = await stream.next(disconnected)
                if out.error is not None:
                    return openai_error(out.error, 400, "messages" if chat else "prompt")
                pieces.append(out.text)
                if out.finished:
                    break
        except ServerFailure as e:
            return openai_error(f"server failure: {e}", 503)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        finally:
            disconnected.cancel()
            if not stream.finished:
                self.client.abort(stream.rid)
        text = "".join(pieces)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": out.finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice], "usage": _usage(out),
        })  # fmt: skip

    async def _start_stream(self, request, body, stream: RequestStream, rid, chat, disconnected) -> Response:
        usage = include_usage(body)
        try:
            first = await stream.next(disconnected)  # a rejection before any token still gets its status code
        except (ServerFailure, ClientDisconnected) as e:
            disconnected.cancel()
            self.client.abort(stream.rid)
            if isinstance(e, ServerFailure):
                return openai_error(f"server failure: {e}", 503)
            return Response(status_code=_CLIENT_CLOSED)
        if first.error is not None:
            disconnected.cancel()
            return openai_error(first.error, 400, "messages" if chat else "prompt")
        events = self._events(stream, first, rid, chat, usage, disconnected)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, stream, first: TextOutput, rid, chat, usage, disconnected) -> AsyncIterator[str]:
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            event = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            return f"data: {json.dumps({**event, **extra}, ensure_ascii=False)}\n\n"

        def choice(text: str | None, finish_reason: str | None, role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

        out = first
        try:
            if chat:
                yield chunk([choice(None, None, role=True)])
            while True:
                if out.text:
                    yield chunk([choice(out.text, None)])
                if out.finished:
                    yield chunk([choice(None, out.finish_reason)])
                    if usage:
                        yield chunk([], usage=_usage(out))
                    yield "data: [DONE]\n\n"
                    return
                out = await stream.next(disconnected)
        except ServerFailure as e:
            error = {"message": f"server failure: {e}", "type": "server_error", "param": None, "code": 503}
            yield f"data: {json.dumps({'error': error})}\n\n"
        except ClientDisconnected:
            return
        finally:
            disconnected.cancel()
            if not stream.finished:
                self.client.abort(stream.rid)


def _usage(out: TextOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.output_tokens,
            "total_tokens": out.prompt_tokens + out.output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}  # fmt: skip


def add_openai_routes(app: FastAPI, client: EngineClient, options: OpenAIOptions) -> None:
    serving: list[OpenAIServing] = []  # built on first use: the tokenizer is there, the event loop is running

    def get() -> OpenAIServing:
        if not serving:
            serving.append(OpenAIServing(client, options))
        return serving[0]

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(get().models())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await get().respond(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await get().respond(request, "completion")
