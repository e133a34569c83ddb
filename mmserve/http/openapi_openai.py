"""The OpenAI routes' request bodies as /openapi.json describes them (mmserve/http/openapi.py): chat and completion
fields as openai_protocol.py reads them, the output constraints (structured.py), tools, and vLLM's extra sampling
fields."""

from __future__ import annotations

from language.sampling_params import MAX_TOP_LOGPROBS
from mmserve.http.openai_extras import MAX_BATCH_SEQUENCES
from mmserve.http.openai_protocol import CHAT_NAMES, COMPLETION_NAMES, MAX_COMPLETION_LOGPROBS
from mmserve.http.openapi_generate import MM_PROCESSOR_KWARGS, PARAMETER_SCHEMAS
from mmserve.http.openapi_types import (
    BOOL,
    CONSTRAINT_TEXT,
    REPETITION_PENALTY,
    SCHEMA,
    SEQUENCES,
    STOP,
    STRING,
    TOKEN_IDS,
    TOP_P,
    check_covered,
    nullable,
    number,
)

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
        "content": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}),
        "tool_calls": nullable({"type": "array", "items": {
            "type": "object", "required": ["function"],
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string", "description": "JSON"}}}}}}),
        "tool_call_id": nullable({"type": "string"}),
        "name": nullable({"type": "string"}),
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
            "strict": BOOL,
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
    "properties": {"name": {"type": "string", "minLength": 1}, "schema": SCHEMA,
                   "description": nullable({"type": "string"}), "strict": nullable(BOOL)},
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
    "response_format": nullable(_RESPONSE_FORMAT),
    "structured_outputs": nullable({
        "type": "object", "additionalProperties": False, "minProperties": 1,
        "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object, structural_tag",
        "properties": {
            "json": {"anyOf": [SCHEMA, CONSTRAINT_TEXT]}, "regex": CONSTRAINT_TEXT, "choice": _CHOICE,
            "grammar": {**CONSTRAINT_TEXT, "description": "EBNF (GBNF)"}, "json_object": nullable(BOOL),
            "structural_tag": {"anyOf": [_STRUCTURAL_TAG, CONSTRAINT_TEXT]},
            "disable_fallback": nullable(BOOL), "disable_additional_properties": nullable(BOOL),
            "disable_any_whitespace": {"enum": [None, False], "description": "not supported"},
            "whitespace_pattern": {"type": "null", "description": "not supported"},
        },
    }),
    "guided_json": nullable({"anyOf": [SCHEMA, CONSTRAINT_TEXT]}),
    "guided_regex": nullable(CONSTRAINT_TEXT),
    "guided_choice": nullable(_CHOICE),
    "guided_grammar": nullable({**CONSTRAINT_TEXT, "description": "EBNF (GBNF)"}),
    "guided_decoding_backend": nullable({"type": "string", "pattern": "^(xgrammar|auto)(:.*)?$"}),
    "guided_whitespace_pattern": {"type": "null", "description": "not supported"},
}  # fmt: skip
_MAX_TOKENS = nullable({"type": "integer", "minimum": 1})
OPENAI_SCHEMAS: dict[str, dict] = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models), or absent"},
    "max_tokens": _MAX_TOKENS,
    "max_completion_tokens": _MAX_TOKENS,
    "temperature": nullable(number(0, 100)),
    "top_p": nullable(TOP_P),
    "top_k": nullable(PARAMETER_SCHEMAS["top_k"]),
    "min_p": nullable(PARAMETER_SCHEMAS["min_p"]),
    "seed": PARAMETER_SCHEMAS["seed"],
    "stop": STOP,
    "n": SEQUENCES,
    "stream": nullable(BOOL),
    "stream_options": nullable({"type": "object", "properties": {
        "include_usage": BOOL,
        "continuous_usage_stats": {**BOOL, "description": "with include_usage: each chunk carries its choice's "
                                                            "usage so far"}},
        "description": "only with stream: true"}),  # fmt: skip
    "presence_penalty": nullable(number(-2, 2)),
    "frequency_penalty": nullable(number(-2, 2)),
    "repetition_penalty": nullable(REPETITION_PENALTY),
    "ignore_eos": nullable(BOOL),
    "user": {"type": "string"},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "chat_template_kwargs": nullable({"type": "object"}),
    "mm_processor_kwargs": MM_PROCESSOR_KWARGS,
    "add_generation_prompt": BOOL,
    "tools": nullable({"type": "array", "items": _TOOL}),
    "tool_choice": nullable(_TOOL_CHOICE),
    "parallel_tool_calls": nullable(BOOL),
    "prompt": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": STRING}, {**TOKEN_IDS, "minItems": 1},
                         {"type": "array", "minItems": 1, "items": {**TOKEN_IDS, "minItems": 1}}],
               "description": "a string, a list of strings, a token-id list or a list of token-id lists (ids in the "
                              "tokenizer's vocabulary); choice i * n + j answers prompt i; prompts x best_of (or n) "
                              f"<= {MAX_BATCH_SEQUENCES}"},
    "echo": BOOL,
    **STRUCTURED_SCHEMAS,
}  # fmt: skip
# vLLM's extra sampling fields (and LightLLM's do_sample), as /generate's parameters run them (openai_extras.py)
OPENAI_EXTRA_SCHEMAS: dict[str, dict] = {
    "logit_bias": PARAMETER_SCHEMAS["logit_bias"],
    "best_of": {**SEQUENCES, "description": ">= n (equal with stream); the n most likely of best_of are returned"},
    "stop_token_ids": nullable(TOKEN_IDS),
    "min_tokens": {**nullable({"type": "integer", "minimum": 0}), "description": "EOS and stop ids held off until "
                                                                                  "this many tokens; <= max_tokens"},
    "allowed_token_ids": PARAMETER_SCHEMAS["allowed_token_ids"],
    "prompt_logprobs": {**nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                        "description": "each prompt token's logprob and this many alternatives (not with stream)"},
    "do_sample": {**nullable(BOOL), "description": "LightLLM's: false is greedy whatever the temperature"},
    "skip_special_tokens": nullable(BOOL),
    "spaces_between_special_tokens": nullable(BOOL),
    "add_special_tokens": nullable(BOOL),
    "include_stop_str_in_output": {**nullable(BOOL), "description": "the stop string that ended the text stays in it"},
}  # fmt: skip
_LOGPROBS = {
    "chat": {"logprobs": nullable(BOOL),
             "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})},
    "completion": {"logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}),
                   "top_logprobs": {"type": "null", "description": "a chat field"}},
}  # fmt: skip


def openai_body(kind: str) -> dict:
    names = CHAT_NAMES if kind == "chat" else COMPLETION_NAMES
    schemas = OPENAI_SCHEMAS | OPENAI_EXTRA_SCHEMAS | _LOGPROBS[kind]
    check_covered(schemas, names, "OPENAI_SCHEMAS")
    required = ["messages"] if kind == "chat" else ["prompt"]
    properties = {name: schemas[name] for name in sorted(names)}
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}
