"""/generate's request body as /openapi.json describes it (mmserve/http/openapi.py): LightLLM's top-level fields
and its `parameters`, with the ranges SamplingParams.validate checks."""

from __future__ import annotations

from language.sampling_params import MAX_DECAY_FACTOR, MAX_TOKEN_ID, MAX_TOP_K, MAX_TOP_LOGPROBS
from mmserve.http.openapi_types import (
    BOOL,
    CONSTRAINT_TEXT,
    REPETITION_PENALTY,
    SCHEMA,
    SEQUENCES,
    STOP,
    TOKEN_IDS,
    TOP_P,
    check_covered,
    nullable,
    number,
)
from mmserve.http.protocol import PARAMETER_NAMES, TOP_LEVEL_NAMES

# /generate's `parameters` (LightLLM's names; ranges as SamplingParams.validate checks them).
PARAMETER_SCHEMAS: dict[str, dict] = {
    "do_sample": BOOL,
    "temperature": number(0, 100),
    "top_p": TOP_P,
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_TOP_K, "description": "-1 or 0: no top-k cut"},
    "min_p": {**number(0, 1), "description": "drop ids less likely than min_p times the most likely (0: off)"},
    "max_new_tokens": {"type": "integer", "minimum": 1, "description": "prompt + max_new_tokens <= the context"},
    "stop_sequences": STOP,
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": BOOL,
    "repetition_penalty": REPETITION_PENALTY,
    "frequency_penalty": number(-2, 2),
    "presence_penalty": number(-2, 2),
    "seed": nullable({"type": "integer", "minimum": 0, "exclusiveMaximum": 2**63}),  # exact as a float, too
    "return_details": BOOL,
    "disable_prompt_cache": BOOL,
    "n": SEQUENCES,
    "best_of": {**SEQUENCES, "description": ">= n; the n most likely of best_of sequences are returned"},
    "min_new_tokens": {**nullable({"type": "integer", "minimum": 0}), "description": "<= max_new_tokens"},
    "allowed_token_ids": nullable({**TOKEN_IDS, "minItems": 1}),
    "logit_bias": nullable(
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": number(-100, 100)}
    ),  # fmt: skip
    "exponential_decay_length_penalty": nullable(
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "description": "[start_index, decay_factor]",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, number(1, MAX_DECAY_FACTOR)],
        }
    ),  # fmt: skip
    "input_penalty": BOOL,
    "skip_special_tokens": BOOL,
    "add_special_tokens": nullable(BOOL),
    "add_spaces_between_special_tokens": BOOL,
    "print_eos_token": BOOL,
    "include_stop_str_in_output": {**BOOL, "description": "vLLM's: the stop string that ended the text stays in it"},
    "image_max_patch_num": {
        **nullable({"type": "integer", "minimum": -1, "maximum": 64}),
        "description": "InternVL's tile cap per image (-1: the checkpoint's max_patches); other families ignore it",
    },
    "group_request_id": {**nullable({"type": "integer"}), "description": "accepted, ignored"},
    "prompt_logprobs": nullable({"anyOf": [BOOL, {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}]}),
    # LightLLM's output constraints (one per request, not with allowed_token_ids); null, false or "": none
    "guided_json": {**nullable({"anyOf": [SCHEMA, CONSTRAINT_TEXT]}), "description": "a JSON schema (or its text)"},
    "regular_constraint": {**nullable(CONSTRAINT_TEXT), "description": "a regular expression"},
    "guided_grammar": {**nullable(CONSTRAINT_TEXT), "description": 'an EBNF grammar; "json": any JSON object'},
}


def _media_item(medium: str) -> dict:
    """One entry of multimodal_params.images or .videos."""
    return {
        "type": "object",
        "required": ["type", "data"],
        "properties": {
            "type": {"enum": ["url", "base64"]},
            "data": {"type": "string", "description": f"an http(s) URL, or the {medium} file's bytes in base64"},
        },
    }


MM_PROCESSOR_KWARGS = nullable({
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
    "multimodal_params": nullable({"type": "object", "additionalProperties": False,
                                    "properties": {"images": nullable({"type": "array", "items": _media_item("image")}),
                                                   "videos": nullable({"type": "array", "items": _media_item("video")}),
                                                   "mm_processor_kwargs": MM_PROCESSOR_KWARGS}}),
}  # fmt: skip


def generate_body() -> dict:
    parameters = {name: PARAMETER_SCHEMAS[name] for name in sorted(PARAMETER_NAMES)}
    check_covered(PARAMETER_SCHEMAS, PARAMETER_NAMES, "PARAMETER_SCHEMAS")
    fields = {name: _GENERATE_FIELDS[name] for name in sorted(TOP_LEVEL_NAMES)}
    check_covered(_GENERATE_FIELDS, TOP_LEVEL_NAMES, "_GENERATE_FIELDS")
    fields["parameters"] = nullable({**fields["parameters"], "properties": parameters})
    return {"type": "object", "additionalProperties": False, "properties": fields,
            "anyOf": [{"required": ["inputs"]}, {"required": ["input"]}]}  # fmt: skip
