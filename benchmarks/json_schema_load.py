"""serve_bench's `--json_schema PATH|builtin`: the same loads with each request's output constrained to a JSON schema
(LightLLM's /generate parameter `guided_json`, the constraint OpenAI's response_format json_schema maps to), so that
constrained throughput can be set against the same load unconstrained.

The built-in schema describes the objects in a picture: nested objects, enums, bounded integers, booleans and
fixed-length arrays, the structure a form or receipt extraction asks for. `builtin_maxlength` has free strings with
a maxLength (a summary, each object's name) and unbounded numbers instead: xgrammar cannot precompute the masks of a
bounded repetition, so each step checks the whole vocabulary against each row inside such a string (the worst case
of the host's mask work). Each `objects` list needs at least 64 entries of some 20 tokens each, so no answer can
close it within 1000 new tokens: every request still runs its `max_new_tokens` under `ignore_eos`, token for token
the unconstrained load's work, with a mask at every step.

Against one running server, give each of the two runs its own `--image_round` (or neither after a warm-up of both):
the second run of a load would otherwise find its images in the embedding cache.

    python benchmarks/serve_bench.py --url URL --loads img336_x64 --image_round 1
    python benchmarks/serve_bench.py --url URL --loads img336_x64 --image_round 2 --json_schema builtin"""

from __future__ import annotations

import functools
import json

BUILTIN = "builtin"
BUILTIN_MAXLENGTH = "builtin_maxlength"
MIN_OBJECTS = 64

_COLORS = ["red", "green", "blue", "yellow", "black", "white", "other"]


def objects_schema(head: tuple[str, dict], name: dict, coordinate: dict) -> dict:
    """A picture's description: the field `head` and a list of MIN_OBJECTS to 2 * MIN_OBJECTS objects, each with a
    `name`, a color, a count, a visibility flag and a box of four `coordinate`s."""
    head_key, head_schema = head
    item = {
        "type": "object",
        "properties": {
            "name": name,
            "color": {"enum": _COLORS},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "visible": {"type": "boolean"},
            "box": {"type": "array", "items": coordinate, "minItems": 4, "maxItems": 4},
        },
        "required": ["name", "color", "count", "visible", "box"],
    }
    objects = {"type": "array", "minItems": MIN_OBJECTS, "maxItems": 2 * MIN_OBJECTS, "items": item}
    return {
        "type": "object",
        "properties": {head_key: head_schema, "objects": objects},
        "required": [head_key, "objects"],
    }


OBJECTS_SCHEMA_MAXLENGTH = objects_schema(
    ("summary", {"type": "string", "maxLength": 200}),
    name={"type": "string", "maxLength": 32},
    coordinate={"type": "number"},
)
# The same structure with no free text (names from a list, integer coordinates): a random model would never close a
# string without a maxLength (almost every token is string content), so this one walks the structure the way a
# trained model's answer does, through the states whose masks xgrammar precomputes.
_NAMES = ["person", "car", "tree", "dog", "cat", "house", "bicycle", "sign", "cup", "chair", "table", "window"]
OBJECTS_SCHEMA = objects_schema(
    ("scene", {"enum": ["street", "room", "park", "kitchen", "office", "other"]}),
    name={"enum": _NAMES},
    coordinate={"type": "integer", "minimum": 0, "maximum": 4096},
)


@functools.cache  # read once per run, not once per request
def load_schema(arg: str | None) -> dict | None:
    """--json_schema's value -> the schema: None (no constraint), "builtin", "builtin_maxlength", or a JSON file's
    path."""
    if arg is None:
        return None
    if arg == BUILTIN:
        return OBJECTS_SCHEMA
    if arg == BUILTIN_MAXLENGTH:
        return OBJECTS_SCHEMA_MAXLENGTH
    with open(arg) as f:
        schema = json.load(f)
    if not isinstance(schema, dict):
        raise SystemExit(f"--json_schema {arg}: the file must hold a JSON schema (an object)")
    return schema
