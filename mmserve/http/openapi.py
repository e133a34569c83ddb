"""What /openapi.json says about each route: request bodies and answers as JSON schemas.

The routes parse their bodies by hand (protocol.py, openai_protocol.py: multi-MB image bodies stay off pydantic), so
FastAPI sees no body model; these schemas are handed to it through `openapi_extra` and `responses`. The field names
come from the parsers' own tables (PARAMETER_NAMES, CHAT_NAMES, ...) and each must have a schema here: a name added
to a table without one fails the app's construction, so the description cannot fall behind the parser.
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse, Response

from language.sampling_params import (
    MAX_CONSTRAINT_CHARS,
    MAX_DECAY_FACTOR,
    MAX_REPETITION_PENALTY,
    MAX_SEQUENCES,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
)
from mmserve.http.drain import RETRY_AFTER_S
from mmserve.http.openai_extras import (
    DETOKENIZE_NAMES,
    MAX_BATCH_SEQUENCES,
    TOKENIZE_CHAT_NAMES,
    TOKENIZE_NAMES,
)
from mmserve.http.openai_protocol import CHAT_NAMES, COMPLETION_NAMES, MAX_COMPLETION_LOGPROBS
from mmserve.http.protocol import PARAMETER_NAMES, TOP_LEVEL_NAMES
from mmserve.http.slow_clients import MAX_BODY_BYTES


class EventStream(Response):
    """Documents a server-sent-events answer (the routes return their own StreamingResponse)."""

    media_type = "text/event-stream"


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(low: float, high: float, exclusive_low: bool = False) -> dict:
    low_key = "exclusiveMinimum" if exclusive_low else "minimum"
    return {"type": "number", low_key: low, "maximum": high}


_BOOL = {"type": "boolean"}
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_TOKEN_IDS = {"type": "array", "items": _TOKEN_ID}
_TOP_P = _number(MIN_TOP_P, 1)
_REPETITION_PENALTY = _number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
_STRING = {"type": "string", "minLength": 1}
_STOP = _nullable({"anyOf": [_STRING, {"type": "array", "items": _STRING}]})
_SCHEMA = {"type": "object", "description": "a JSON schema"}
_CONSTRAINT_TEXT = {"type": "string", "maxLength": MAX_CONSTRAINT_CHARS}
_SEQUENCES = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_SEQUENCES})

# /generate's `parameters` (LightLLM's names; ranges as SamplingParams.validate checks them).
PARAMETER_SCHEMAS: dict[str, dict] = {
    "do_sample": _BOOL,
    "temperature": _number(0, 100),
    "top_p": _TOP_P,
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_TOP_K, "description": "-1 or 0: no top-k cut"},
    "max_new_tokens": {"type": "integer", "minimum": 1, "description": "prompt + max_new_tokens <= the context"},
    "stop_sequences": _STOP,
    "stop_token_ids": _TOKEN_IDS,
    "ignore_eos": _BOOL,
    "repetition_penalty": _REPETITION_PENALTY,
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "seed": _nullable({"type": "integer", "minimum": 0, "exclusiveMaximum": 2**63}),  # exact as a float, too
    "return_details": _BOOL,
    "disable_prompt_cache": _BOOL,
    "n": _SEQUENCES,
    "best_of": {**_SEQUENCES, "description": ">= n; the n most likely of best_of sequences are returned"},
    "min_new_tokens": {**_nullable({"type": "integer", "minimum": 0}), "description": "<= max_new_tokens"},
    "allowed_token_ids": _nullable({**_TOKEN_IDS, "minItems": 1}),
    "logit_bias": _nullable(
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": _number(-100, 100)}
    ),  # fmt: skip
    "exponential_decay_length_penalty": _nullable(
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "description": "[start_index, decay_factor]",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, _number(1, MAX_DECAY_FACTOR)],
        }
    ),  # fmt: skip
    "input_penalty": _BOOL,
    "skip_special_tokens": _BOOL,
    "add_special_tokens": _nullable(_BOOL),
    "add_spaces_between_special_tokens": _BOOL,
    "print_eos_token": _BOOL,
    "image_max_patch_num": {
        **_nullable({"type": "integer", "minimum": -1, "maximum": 64}),
        "description": "InternVL's tile cap per image (-1: the checkpoint's max_patches); other families ignore it",
    },
    "group_request_id": {**_nullable({"type": "integer"}), "description": "accepted, ignored"},
    "prompt_logprobs": _nullable({"anyOf": [_BOOL, {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}]}),
    # LightLLM's output constraints (one per request, not with allowed_token_ids); null, false or "": none
    "guided_json": {**_nullable({"anyOf": [_SCHEMA, _CONSTRAINT_TEXT]}), "description": "a JSON schema (or its text)"},
    "regular_constraint": {**_nullable(_CONSTRAINT_TEXT), "description": "a regular expression"},
    "guided_grammar": {**_nullable(_CONSTRAINT_TEXT), "description": 'an EBNF grammar; "json": any JSON object'},
}

_IMAGE = {
    "type": "object",
    "required": ["type", "data"],
    "properties": {
        "type": {"enum": ["url", "base64"]},
        "data": {"type": "string", "description": "an http(s) URL, or the image file's bytes in base64"},
    },
}
_VIDEO = {
    "type": "object",
    "required": ["type", "data"],
    "properties": {
        "type": {"enum": ["url", "base64"]},
        "data": {"type": "string", "description": "an http(s) URL, or the video file's bytes in base64"},
    },
}
_MM_PROCESSOR_KWARGS = _nullable({
    "type": "object", "additionalProperties": False,
    "description": "the video processor's sampling for this request's videos (vLLM's name)",
    "properties": {"fps": {"type": "number", "exclusiveMinimum": 0},
                   **{k: {"type": "integer", "minimum": 1}
                      for k in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels")}},
})  # fmt: skip
_GENERATE_FIELDS: dict[str, dict] = {
    "inputs": {"type": "string", "minLength": 1, "description": "the prompt, with the model's image placeholders"},
    "input": {"type": "string", "minLength": 1, "description": "another name for inputs"},
    "parameters": {"type": "object", "additionalProperties": False},  # properties filled in by generate_body()
    "multimodal_params": _nullable({"type": "object", "additionalProperties": False,
                                    "properties": {"images": _nullable({"type": "array", "items": _IMAGE}),
                                                   "videos": _nullable({"type": "array", "items": _VIDEO}),
                                                   "mm_processor_kwargs": _MM_PROCESSOR_KWARGS}}),
}  # fmt: skip


def generate_body() -> dict:
    parameters = {name: PARAMETER_SCHEMAS[name] for name in sorted(PARAMETER_NAMES)}
    _check_covered(PARAMETER_SCHEMAS, PARAMETER_NAMES, "PARAMETER_SCHEMAS")
    fields = {name: _GENERATE_FIELDS[name] for name in sorted(TOP_LEVEL_NAMES)}
    _check_covered(_GENERATE_FIELDS, TOP_LEVEL_NAMES, "_GENERATE_FIELDS")
    fields["parameters"] = _nullable({**fields["parameters"], "properties": parameters})
    return {"type": "object", "additionalProperties": False, "properties": fields,
            "anyOf": [{"required": ["inputs"]}, {"required": ["input"]}]}  # fmt: skip


# The OpenAI routes' fields (as openai_protocol.py reads them).
_PART = {"anyOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"},
        "image_url": {"type": "object", "required": ["url"],
                      "properties": {"url": {"type": "string", "minLength": 1}}},
    }},
]}  # fmt: skip
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1,
                 "description": "system, user, assistant, tool, developer or any role the chat template takes"},
        "content": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}),
        "tool_calls": _nullable({"type": "array", "items": {
            "type": "object", "required": ["function"],
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string", "description": "JSON"}}}}}}),
        "tool_call_id": _nullable({"type": "string"}),
        "name": _nullable({"type": "string"}),
    },
}  # fmt: skip
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "a JSON schema of the arguments"},
            "strict": _BOOL,
        }},
    },
}  # fmt: skip
_TOOL_CHOICE = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
], "description": "required and a named function are enforced (needs --tool_call_parser)"}  # fmt: skip
# Output constraints (structured.py): one per request.
_JSON_SCHEMA_FORMAT = {
    "type": "object", "required": ["name", "schema"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "minLength": 1}, "schema": _SCHEMA,
                   "description": _nullable({"type": "string"}), "strict": _nullable(_BOOL)},
}  # fmt: skip
_STRUCTURAL_TAG = {"type": "object", "description": "xgrammar's structural tag: {format}, or {structures, triggers}"}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "additionalProperties": False,
     "properties": {"type": {"enum": ["text", "json_object"]}}, "description": "text: no constraint"},
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
     "properties": {"type": {"const": "json_schema"}, "json_schema": _JSON_SCHEMA_FORMAT}},
    {**_STRUCTURAL_TAG, "required": ["type"], "properties": {"type": {"const": "structural_tag"}}},
]}  # fmt: skip
_CHOICE = {"type": "array", "minItems": 1, "items": {"type": "string"}, "description": "the output is one of these"}
STRUCTURED_SCHEMAS: dict[str, dict] = {
    "response_format": _nullable(_RESPONSE_FORMAT),
    "structured_outputs": _nullable({
        "type": "object", "additionalProperties": False, "minProperties": 1,
        "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object, structural_tag",
        "properties": {
            "json": {"anyOf": [_SCHEMA, _CONSTRAINT_TEXT]}, "regex": _CONSTRAINT_TEXT, "choice": _CHOICE,
            "grammar": {**_CONSTRAINT_TEXT, "description": "EBNF (GBNF)"}, "json_object": _nullable(_BOOL),
            "structural_tag": {"anyOf": [_STRUCTURAL_TAG, _CONSTRAINT_TEXT]},
            "disable_fallback": _nullable(_BOOL), "disable_additional_properties": _nullable(_BOOL),
            "disable_any_whitespace": {"enum": [None, False], "description": "not supported"},
            "whitespace_pattern": {"type": "null", "description": "not supported"},
        },
    }),
    "guided_json": _nullable({"anyOf": [_SCHEMA, _CONSTRAINT_TEXT]}),
    "guided_regex": _nullable(_CONSTRAINT_TEXT),
    "guided_choice": _nullable(_CHOICE),
    "guided_grammar": _nullable({**_CONSTRAINT_TEXT, "description": "EBNF (GBNF)"}),
    "guided_decoding_backend": _nullable({"type": "string", "pattern": "^(xgrammar|auto)(:.*)?$"}),
    "guided_whitespace_pattern": {"type": "null", "description": "not supported"},
}  # fmt: skip
_MAX_TOKENS = _nullable({"type": "integer", "minimum": 1})
OPENAI_SCHEMAS: dict[str, dict] = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models), or absent"},
    "max_tokens": _MAX_TOKENS,
    "max_completion_tokens": _MAX_TOKENS,
    "temperature": _nullable(_number(0, 100)),
    "top_p": _nullable(_TOP_P),
    "top_k": _nullable(PARAMETER_SCHEMAS["top_k"]),
    "seed": PARAMETER_SCHEMAS["seed"],
    "stop": _STOP,
    "n": _SEQUENCES,
    "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "properties": {
        "include_usage": _BOOL,
        "continuous_usage_stats": {**_BOOL, "description": "with include_usage: each chunk carries its choice's "
                                                            "usage so far"}},
        "description": "only with stream: true"}),  # fmt: skip
    "presence_penalty": _nullable(_number(-2, 2)),
    "frequency_penalty": _nullable(_number(-2, 2)),
    "repetition_penalty": _nullable(_REPETITION_PENALTY),
    "ignore_eos": _nullable(_BOOL),
    "user": {"type": "string"},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "chat_template_kwargs": _nullable({"type": "object"}),
    "mm_processor_kwargs": _MM_PROCESSOR_KWARGS,
    "add_generation_prompt": _BOOL,
    "tools": _nullable({"type": "array", "items": _TOOL}),
    "tool_choice": _nullable(_TOOL_CHOICE),
    "parallel_tool_calls": _nullable(_BOOL),
    "prompt": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _STRING}, {**_TOKEN_IDS, "minItems": 1},
                         {"type": "array", "minItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}],
               "description": "a string, a list of strings, a token-id list or a list of token-id lists (ids in the "
                              "tokenizer's vocabulary); choice i * n + j answers prompt i; prompts x best_of (or n) "
                              f"<= {MAX_BATCH_SEQUENCES}"},
    "echo": _BOOL,
    **STRUCTURED_SCHEMAS,
}  # fmt: skip
# vLLM's extra sampling fields (and LightLLM's do_sample), as /generate's parameters run them (openai_extras.py)
OPENAI_EXTRA_SCHEMAS: dict[str, dict] = {
    "logit_bias": PARAMETER_SCHEMAS["logit_bias"],
    "best_of": {**_SEQUENCES, "description": ">= n (equal with stream); the n most likely of best_of are returned"},
    "stop_token_ids": _nullable(_TOKEN_IDS),
    "min_tokens": {**_nullable({"type": "integer", "minimum": 0}), "description": "EOS and stop ids held off until "
                                                                                  "this many tokens; <= max_tokens"},
    "allowed_token_ids": PARAMETER_SCHEMAS["allowed_token_ids"],
    "prompt_logprobs": {**_nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                        "description": "each prompt token's logprob and this many alternatives (not with stream)"},
    "do_sample": {**_nullable(_BOOL), "description": "LightLLM's: false is greedy whatever the temperature"},
    "skip_special_tokens": _nullable(_BOOL),
    "spaces_between_special_tokens": _nullable(_BOOL),
    "add_special_tokens": _nullable(_BOOL),
}  # fmt: skip
_LOGPROBS = {
    "chat": {"logprobs": _nullable(_BOOL),
             "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})},
    "completion": {"logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}),
                   "top_logprobs": {"type": "null", "description": "a chat field"}},
}  # fmt: skip


def openai_body(kind: str) -> dict:
    names = CHAT_NAMES if kind == "chat" else COMPLETION_NAMES
    schemas = OPENAI_SCHEMAS | OPENAI_EXTRA_SCHEMAS | _LOGPROBS[kind]
    _check_covered(schemas, names, "OPENAI_SCHEMAS")
    required = ["messages"] if kind == "chat" else ["prompt"]
    properties = {name: schemas[name] for name in sorted(names)}
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


def _check_covered(schemas: dict, names: frozenset, table: str) -> None:
    missing = sorted(set(names) - set(schemas))
    if missing:
        raise KeyError(f"{table} has no schema for {missing}: describe each field the parser accepts")


# ------------------------------------------------------------------------------------------------- answers

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}, "field": {"type": "string", "description": "the offending field"}},
}
OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": _nullable({"type": "string"}),
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
    "add_special_tokens": {**_BOOL, "description": "default: true for a prompt, false for messages"},
    "return_token_strs": _BOOL,
    "add_generation_prompt": _BOOL,
    "chat_template_kwargs": OPENAI_SCHEMAS["chat_template_kwargs"],
    "tokens": _TOKEN_IDS,
}


def _tokenizer_route(names: frozenset, answer: dict, summary: str, **body_extra) -> dict:
    _check_covered(_TOKENIZE_FIELDS, names, "_TOKENIZE_FIELDS")
    return {"summary": summary, "responses": {
        200: {"description": summary, "content": {"application/json": {"schema": answer}}},
        **_errors(OPENAI_ERROR, {404: "`model` names another model"})},
        "openapi_extra": _body({"type": "object", "additionalProperties": False, **body_extra,
                                "properties": {name: _TOKENIZE_FIELDS[name] for name in sorted(names)}})}  # fmt: skip


TOKENIZE_ROUTE = _tokenizer_route(
    TOKENIZE_NAMES | TOKENIZE_CHAT_NAMES,
    {"type": "object", "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                      "tokens": _TOKEN_IDS, "token_strs": _nullable({"type": "array"})}},
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
