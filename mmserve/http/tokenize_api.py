"""vLLM's tokenizer endpoints and OpenAI's model card by id: POST /tokenize (a prompt, or chat messages rendered by
the chat template the chat route uses), POST /detokenize (token ids -> text) and GET /v1/models/{model}. Errors
come in OpenAI's shape, as the other /v1 routes'."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmserve.http.openai_api import OpenAIServing, openai_error
from mmserve.http.openai_extras import DETOKENIZE_NAMES, TOKENIZE_CHAT_NAMES, TOKENIZE_NAMES
from mmserve.http.openai_protocol import chat_messages, check_names, openai_param, render_chat
from mmserve.http.openapi import DETOKENIZE_ROUTE, MODEL_ROUTE, TOKENIZE_ROUTE
from mmserve.http.protocol import BadRequest, parse_json
from mmserve.http.request_io import check_json_content_type, read_request_body


def tokenize(serving: OpenAIServing, body: dict) -> dict:
    """A prompt (special tokens added by default) or messages rendered by the chat template (none added by default:
    the template writes them), as the server would tokenize them; runs in the tokenizer pool."""
    chat = "messages" in body
    check_names(body, TOKENIZE_CHAT_NAMES if chat else TOKENIZE_NAMES)
    add_special = body.get("add_special_tokens", not chat)
    if not isinstance(add_special, bool):
        raise BadRequest("add_special_tokens", "must be a boolean")
    if chat:
        messages, images, videos = chat_messages(body["messages"], serving.image_dir, serving.multimodal)
        if images or videos:
            raise BadRequest("messages", "/tokenize counts text: image and video parts are expanded only when a "
                                         "request runs")  # fmt: skip
        text = render_chat(serving.tokenizer, serving.template, messages, body)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise BadRequest("prompt", "must be a string (or send messages)")
    tokens = serving.tokenizer.encode(text, add_special_tokens=add_special)
    strs = serving.tokenizer.convert_ids_to_tokens(tokens) if body.get("return_token_strs") else None
    return {"count": len(tokens), "max_model_len": serving.max_len, "tokens": tokens, "token_strs": strs}


def detokenize(serving: OpenAIServing, body: dict) -> dict:
    check_names(body, DETOKENIZE_NAMES)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens", "must be a list of token ids")
    vocab = len(serving.tokenizer)
    outside = sorted({t for t in tokens if not 0 <= t < vocab})
    if outside:
        raise BadRequest("tokens", f"token ids {outside[:8]} are out of the vocabulary (size {vocab})")
    return {"prompt": serving.tokenizer.decode(tokens)}


async def _answer(serving: OpenAIServing, request: Request, work: Callable[[OpenAIServing, dict], dict]) -> Response:
    body = None
    try:
        check_json_content_type(request)
        body = await serving.client.run_sync(parse_json, await read_request_body(request))
        model = body.get("model")
        if model is not None and model != serving.model_name:
            return openai_error(f"The model `{model}` does not exist.", 404, "model")
        return JSONResponse(await serving.client.run_sync(work, serving, body))
    except BadRequest as e:
        param, message = openai_param(e, body, "messages" if body and "messages" in body else "prompt")
        return openai_error(message, e.status, param)


def add_tokenize_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/tokenize", **TOKENIZE_ROUTE)
    async def tokenize_route(request: Request) -> Response:
        return await _answer(serving, request, tokenize)

    @app.post("/detokenize", **DETOKENIZE_ROUTE)
    async def detokenize_route(request: Request) -> Response:
        return await _answer(serving, request, detokenize)

    @app.get("/v1/models/{model:path}", **MODEL_ROUTE)
    async def model_card(model: str) -> Response:
        card = serving.models()["data"][0]
        if model != card["id"]:
            return openai_error(f"The model `{model}` does not exist.", 404, "model")
        return JSONResponse(card)
