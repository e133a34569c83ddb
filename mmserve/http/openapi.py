"""What /openapi.json says about each route: request bodies and answers as JSON schemas.

The routes parse their bodies by hand (protocol.py, openai_protocol.py: multi-MB image bodies stay off pydantic), so
FastAPI sees no body model; these schemas are handed to it through `openapi_extra` and `responses`. The field names
come from the parsers' own tables (PARAMETER_NAMES, CHAT_NAMES, ...) and each must have a schema here: a name added
to a table without one fails the app's construction, so the description cannot fall behind the parser.

The request bodies are described in openapi_generate.py (/generate) and openapi_openai.py (the OpenAI routes), from
the building blocks in openapi_types.py; this module holds the answers and each route's decorator arguments.
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse, Response

from mmserve.http.drain import RETRY_AFTER_S
from mmserve.http.openai_extras import DETOKENIZE_NAMES, TOKENIZE_CHAT_NAMES, TOKENIZE_NAMES
from mmserve.http.openapi_generate import generate_body
from mmserve.http.openapi_openai import OPENAI_SCHEMAS, openai_body
from mmserve.http.openapi_types import BOOL, TOKEN_IDS, check_covered, nullable
from mmserve.http.slow_clients import MAX_BODY_BYTES


class EventStream(Response):
    """Documents a server-sent-events answer (the routes return their own StreamingResponse)."""

    media_type = "text/event-stream"


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}, "field": {"type": "string", "description": "the offending field"}},
}
OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": nullable({"type": "string"}),
        "code": {"type": "integer"}}}},
}  # fmt: skip
_ERRORS = {
    400: "the body or a field is invalid (the answer names it)",
    408: "the body did not arrive within --request_read_timeout",
    413: f"the body is larger than {MAX_BODY_BYTES >> 20} MiB",
    503: f"the server cannot serve now (a process is down, or it is draining): retry after {RETRY_AFTER_S} s",
}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}


def _errors(schema: dict, extra: dict[int, str] | None = None) -> dict:
    out = {}
    for status, text in (_ERRORS | (extra or {})).items():
        out[status] = {"description": text, "content": {"application/json": {"schema": schema}}}
        if status == 503:
            out[status]["headers"] = _RETRY_AFTER
    return out


_GENERATED = {
    "type": "object",
    "properties": {
        "generated_text": {"type": "array", "items": {"type": "string"}},
        "count_output_tokens": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "integer"}}]},
        "finish_reason": {"description": "stop, length or abort (a list with n > 1)"},
        "prompt_tokens": {"type": "integer"},
        "tokens": {"type": "array", "description": "with return_details"},
        "logprobs": {"type": "array", "description": "per token: {id: {logprob, rank, decoded_token}}"},
        "input_usage": {"type": "object", "properties": {
            "input_text_tokens": {"type": "integer"}, "input_audio_tokens": {"type": "integer"},
            "input_image_tokens": {"type": "integer"}}},
    },
}  # fmt: skip
_SSE = {"type": "string", "description": "server-sent events, `data:{...}`; the last has finished: true"}
_GENERATE_SSE = {
    "type": "string",
    "description": 'server-sent events as LightLLM\'s, one per token: `data:{"token": {"id", "text", '
    '"logprob", "special", "count_output_tokens", "prompt_tokens", "logprobs"}, "generated_text", '
    '"finished", "finish_reason", "details", "input_usage", "prompt_cache_len"}`; the last has '
    "finished: true and the whole generated_text",
}


def _body(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def generate_route(stream: bool) -> dict:
    """Keyword arguments for the /generate and /generate_stream decorators."""
    ok = {"content": {"text/event-stream": {"schema": _GENERATE_SSE}}} if stream else {
        "content": {"application/json": {"schema": _GENERATED}}}  # fmt: skip
    return {
        "openapi_extra": _body(generate_body()),
        "responses": {200: {"description": "the generated text", **ok}, **_errors(ERROR)},
        **({"response_class": EventStream} if stream else {}),
    }


def openai_route(kind: str) -> dict:
    """Keyword arguments for /v1/chat/completions and /v1/completions."""
    sse = {**_SSE, "description": "with stream: true; ends with data: [DONE]"}
    ok = {"application/json": {"schema": {"type": "object", "description": "OpenAI's (chat) completion object"}},
          "text/event-stream": {"schema": sse}}  # fmt: skip
    return {
        "openapi_extra": _body(openai_body(kind)),
        "responses": {
            200: {"description": "the completion", "content": ok},
            **_errors(OPENAI_ERROR, {404: "`model` names another model"}),
        },  # fmt: skip
    }


_TOKENIZE_FIELDS = {
    "model": OPENAI_SCHEMAS["model"],
    "prompt": {"type": "string"},
    "messages": OPENAI_SCHEMAS["messages"],
    "add_special_tokens": {**BOOL, "description": "default: true for a prompt, false for messages"},
    "return_token_strs": BOOL,
    "add_generation_prompt": BOOL,
    "chat_template_kwargs": OPENAI_SCHEMAS["chat_template_kwargs"],
    "tokens": TOKEN_IDS,
}


def _tokenizer_route(names: frozenset, answer: dict, summary: str, **body_extra) -> dict:
    check_covered(_TOKENIZE_FIELDS, names, "_TOKENIZE_FIELDS")
    return {"summary": summary, "responses": {
        200: {"description": summary, "content": {"application/json": {"schema": answer}}},
        **_errors(OPENAI_ERROR, {404: "`model` names another model"})},
        "openapi_extra": _body({"type": "object", "additionalProperties": False, **body_extra,
                                "properties": {name: _TOKENIZE_FIELDS[name] for name in sorted(names)}})}  # fmt: skip


TOKENIZE_ROUTE = _tokenizer_route(
    TOKENIZE_NAMES | TOKENIZE_CHAT_NAMES,
    {"type": "object", "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                      "tokens": TOKEN_IDS, "token_strs": nullable({"type": "array"})}},
    "a prompt, or messages rendered by the chat template, as token ids (vLLM's /tokenize)",
    oneOf=[{"required": ["prompt"]}, {"required": ["messages"]}],
)  # fmt: skip
DETOKENIZE_ROUTE = _tokenizer_route(
    DETOKENIZE_NAMES, {"type": "object", "properties": {"prompt": {"type": "string"}}},
    "token ids as text (vLLM's /detokenize)", required=["tokens"],
)  # fmt: skip
MODEL_ROUTE = {"responses": {
    200: {"description": "the model card, as in GET /v1/models", "content": {"application/json": {
        "schema": {"type": "object"}}}},
    404: {"description": "another model", "content": {"application/json": {"schema": OPENAI_ERROR}}}}}  # fmt: skip

HEALTH_ROUTE = {
    "responses": {
        200: {"description": "serving (degraded: text is served, images are not)", "content": {"application/json": {
            "schema": {"type": "object", "properties": {"status": {"enum": ["ok", "degraded"]},
                                                        "message": {"const": "Ok"},
                                                        "error": {"type": "string"}}}}}},
        503: {"description": "a process is down, or the server is draining", "content": {"application/json": {
            "schema": {"type": "object", "properties": {"status": {"enum": ["unhealthy", "draining"]},
                                                        "message": {"const": "Error"},
                                                        "error": {"type": "string"}}}}}},
    }
}  # fmt: skip


def _json_answers(ok: dict, failed: dict | None = None, failed_text: str = "") -> dict:
    """`responses` of a small JSON route: 200 with the body `ok` describes (properties), 503 with `failed`."""
    out = {
        200: {"description": "OK", "content": {"application/json": {"schema": {"type": "object", "properties": ok}}}}
    }
    if failed is not None:
        out[503] = {
            "description": failed_text,
            "content": {"application/json": {"schema": {"type": "object", "properties": failed}}},
        }
    return {"responses": out}  # fmt: skip


# LightLLM's endpoints (lightllm_api.py)
HEALTHZ_ROUTE = {
    "summary": "LightLLM's health check (also HEAD)",
    **_json_answers({"message": {"const": "Ok"}}, {"message": {"const": "Error"}},
                    "a process is down, or the server is draining"),
}  # fmt: skip
LIVENESS_ROUTE = {
    "summary": "LightLLM's liveness probe: 200 while the process serves HTTP, draining included",
    **_json_answers({"status": {"const": "ok"}}),
}
READINESS_ROUTE = {
    "summary": "LightLLM's readiness probe",
    **_json_answers({"status": {"const": "ok"}}, {"status": {"const": "not ready"}, "error": {"type": "string"}},
                    "a process is down, or the server is draining (it takes no new requests)"),
}  # fmt: skip
MODEL_NAME_ROUTE = {
    "summary": "The model id (as /v1/models)",
    **_json_answers({"model_name": {"type": "string"}}),
}
_LOAD = {"type": "number", "minimum": 0}
TOKEN_LOAD_ROUTE = {
    "summary": "KV-cache load as fractions of its token slots (LightLLM's /token_load)",
    **_json_answers({
        "current_load": {**_LOAD, "description": "slots the running requests hold now"},
        "logical_max_load": {**_LOAD, "description": "slots they would hold at their peak (prompt + max_new_tokens)"},
        "dynamic_max_load": {**_LOAD, "description": "as logical_max_load"},
    }),
}  # fmt: skip
METRICS_ROUTE = {
    "response_class": PlainTextResponse,
    "responses": {200: {"description": "Prometheus text exposition format"}},
}
