"""/openapi.json's request schemas (mmserve/http/openapi_generate.py, openapi_openai.py) against the parsers they
describe: every name the parsers accept has a schema, and each numeric range the schema states is the one the parser
enforces, at both edges. An integer the schema leaves unbounded must be accepted even at 2**64: when a parser starts
to refuse it, this test fails until the schema says so too."""

from __future__ import annotations

import pytest

from mmserve.http.openai_protocol import CHAT_NAMES, COMPLETION_NAMES, sampling_params
from mmserve.http.openapi_generate import PARAMETER_SCHEMAS, generate_body
from mmserve.http.openapi_openai import OPENAI_SCHEMAS, openai_body
from mmserve.http.protocol import PARAMETER_NAMES, BadRequest, parse_parameters

HUGE = 2**64


def numeric(schema: dict) -> dict | None:
    """The integer or number alternative of a (possibly nullable) schema."""
    if schema.get("type") in ("integer", "number"):
        return schema
    for alt in schema.get("anyOf", []):
        found = numeric(alt)
        if found is not None:
            return found
    return None


def accepted_by_generate(name: str, value) -> bool:
    extra = {"max_new_tokens": max(value, 1)} if name == "min_new_tokens" else {}  # min <= max_new_tokens
    try:
        parse_parameters({name: value, **extra})
    except BadRequest:
        return False
    return True


def accepted_by_openai(name: str, value) -> bool:
    try:
        sampling_params({name: value}, default_max_tokens=16)
    except BadRequest:
        return False
    return True


def edges_hold(schema: dict, accepts) -> list[str]:
    """What the parser does differently from what the schema says at the range's edges."""
    wrong = []
    step = 1 if schema["type"] == "integer" else 1e-6
    low, high, open_low = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
    checks = []
    if low is not None:
        checks += [(low, True), (low - step, False)]
    if open_low is not None:
        checks += [(open_low, False), (open_low + step, True)]
    if high is not None:
        checks += [(high, True), (high + step, False)]
    elif "exclusiveMaximum" in schema:
        checks += [(schema["exclusiveMaximum"] - step, True), (schema["exclusiveMaximum"], False)]
    elif schema["type"] == "integer":
        checks.append((HUGE, True))
    for value, expected in checks:
        if accepts(value) != expected:
            wrong.append(f"{value} {'refused' if expected else 'accepted'}")
    return wrong


@pytest.mark.parametrize("name", sorted(n for n in PARAMETER_SCHEMAS if numeric(PARAMETER_SCHEMAS[n])))
def test_generate_parameter_ranges_match_the_parser(name):
    assert edges_hold(numeric(PARAMETER_SCHEMAS[name]), lambda v: accepted_by_generate(name, v)) == []


OPENAI_SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "presence_penalty",
                   "frequency_penalty", "repetition_penalty"]  # fmt: skip


@pytest.mark.parametrize("name", OPENAI_SAMPLING)
def test_openai_sampling_ranges_match_the_parser(name):
    assert edges_hold(numeric(OPENAI_SCHEMAS[name]), lambda v: accepted_by_openai(name, v)) == []


def test_every_accepted_name_is_described():
    parameters = generate_body()["properties"]["parameters"]["anyOf"][0]["properties"]
    assert set(parameters) == PARAMETER_NAMES
    assert set(openai_body("chat")["properties"]) == CHAT_NAMES
    assert set(openai_body("completion")["properties"]) == COMPLETION_NAMES
