"""The building blocks of /openapi.json's request schemas (mmserve/http/openapi.py): a nullable field, a number
range, the leaf schemas several fields share, and the check that ties a parser's table of names to its schemas."""

from __future__ import annotations

from language.sampling_params import (
    MAX_CONSTRAINT_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_SEQUENCES,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
)


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def number(low: float, high: float, exclusive_low: bool = False) -> dict:
    low_key = "exclusiveMinimum" if exclusive_low else "minimum"
    return {"type": "number", low_key: low, "maximum": high}


BOOL = {"type": "boolean"}
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
TOKEN_IDS = {"type": "array", "items": TOKEN_ID}
TOP_P = number(MIN_TOP_P, 1)
REPETITION_PENALTY = number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
STRING = {"type": "string", "minLength": 1}
STOP = nullable({"anyOf": [STRING, {"type": "array", "items": STRING}]})
SCHEMA = {"type": "object", "description": "a JSON schema"}
CONSTRAINT_TEXT = {"type": "string", "maxLength": MAX_CONSTRAINT_CHARS}
SEQUENCES = nullable({"type": "integer", "minimum": 1, "maximum": MAX_SEQUENCES})


def check_covered(schemas: dict, names: frozenset, table: str) -> None:
    missing = sorted(set(names) - set(schemas))
    if missing:
        raise KeyError(f"{table} has no schema for {missing}: describe each field the parser accepts")
