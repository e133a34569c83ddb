"""Structured output as each API asks for it -> one `StructuredOutput` (kind, spec) in SamplingParams.

OpenAI's `response_format` (text, json_object, json_schema, and vLLM's structural_tag), vLLM's `structured_outputs`
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and LightLLM's /generate
parameters `guided_json` / `regular_constraint` / `guided_grammar` all become the one constraint the engine compiles.
A request asks for one constraint at most. Each is compiled here first, without a tokenizer (xgrammar's Grammar), in
the tokenizer pool that parses the request, so that a bad schema, regex or grammar gets a 400 naming the client's
own field before anything is queued; results are cached by spec.

Errors are `InvalidParams` naming the client's field (the parsers turn them into 400s): this file sits below both
protocol.py and openai_protocol.py."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import xgrammar

from language.sampling_params import MAX_CONSTRAINT_CHARS, InvalidParams, SamplingParams, StructuredOutput

# vLLM's older names, each one kind; guided_decoding_backend and guided_whitespace_pattern are options, not kinds.
GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OPENAI_NAMES = frozenset(
    {"response_format", "structured_outputs", *GUIDED_KINDS, "guided_decoding_backend", "guided_whitespace_pattern"}
)
# LightLLM's /generate parameters (its SamplingParams): a JSON schema, a regular expression, an EBNF grammar ("json":
# any JSON object, as LightLLM's response_format json_object sends it).
LIGHTLLM_KINDS = {"guided_json": "json", "regular_constraint": "regex", "guided_grammar": "grammar"}
# vLLM's StructuredOutputsParams: one of the kinds, and its options.
_SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object",
             "structural_tag": "structural_tag"}  # fmt: skip
_SO_ACCEPTED_OPTIONS = ("disable_fallback", "disable_additional_properties")  # one backend; xgrammar's strict mode
_SO_REFUSED_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
_BACKENDS = ("xgrammar", "auto")
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "description", "strict"})


@dataclass(frozen=True)
class Constraint:
    field: str  # the client's field that asked for it: errors about the spec, the engine's included, name it
    output: StructuredOutput


# ------------------------------------------------------------------------------------------------- OpenAI / vLLM


def openai_constraint(body: dict) -> Constraint | None:
    """The constraint an OpenAI body asks for (shape checked, not compiled), or None."""
    check_backend_options(body)
    found = []
    if body.get("response_format") is not None:
        found.append(response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        found.append(structured_outputs(body["structured_outputs"]))
    for name, kind in GUIDED_KINDS.items():
        if body.get(name) is not None:
            found.append(Constraint(name, spec_of(kind, body[name], name)))
    return only_one([c for c in found if c is not None])


def openai_field(body: dict) -> str | None:
    """The field of the body's constraint (to name an error the engine reports about it), or None."""
    try:
        constraint = openai_constraint(body)
    except InvalidParams:
        return None
    return constraint.field if constraint is not None else None


def check_backend_options(body: dict) -> None:
    backend = body.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend.split(":")[0] not in _BACKENDS):
        raise InvalidParams("guided_decoding_backend", f"this server decodes with xgrammar: one of {list(_BACKENDS)}")
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidParams("guided_whitespace_pattern", "not supported: xgrammar takes no whitespace pattern")


def response_format(value: object) -> Constraint | None:
    """OpenAI's response_format; {"type": "text"} asks for nothing (SDKs send it on every call)."""
    if not isinstance(value, dict):
        raise InvalidParams("response_format", "must be an object")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in _RESPONSE_FORMAT_TYPES:
        raise InvalidParams("response_format.type", f"must be one of {list(_RESPONSE_FORMAT_TYPES)}")
    if kind == "structural_tag":
        tag = {k: v for k, v in value.items() if k != "type"}
        return Constraint("response_format", spec_of("structural_tag", tag, "response_format"))
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _no_other_keys(value, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", StructuredOutput("json_object"))
    described = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(described, dict):
        raise InvalidParams(where, "must be an object with `name` and `schema`")
    _no_other_keys(described, _JSON_SCHEMA_KEYS, where)
    if not isinstance(described.get("name"), str) or not described["name"]:
        raise InvalidParams(f"{where}.name", "must be a non-empty string")
    for key, kind_name, ok in (("description", "a string", str), ("strict", "a boolean", bool)):
        if described.get(key) is not None and not isinstance(described[key], ok):
            raise InvalidParams(f"{where}.{key}", f"must be {kind_name}")
    if "schema" not in described:
        raise InvalidParams(f"{where}.schema", "is required: the JSON schema the output follows")
    return Constraint(f"{where}.schema", spec_of("json", described["schema"], f"{where}.schema"))


def structured_outputs(value: object) -> Constraint | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag."""
    if not isinstance(value, dict):
        raise InvalidParams("structured_outputs", "must be an object")
    _no_other_keys(value, {*_SO_KINDS, *_SO_ACCEPTED_OPTIONS, *_SO_REFUSED_OPTIONS}, "structured_outputs")
    for option in _SO_REFUSED_OPTIONS:
        if value.get(option) not in (None, False):
            raise InvalidParams(f"structured_outputs.{option}", "not supported with xgrammar")
    for option in _SO_ACCEPTED_OPTIONS:
        if value.get(option) is not None and not isinstance(value[option], bool):
            raise InvalidParams(f"structured_outputs.{option}", "must be a boolean")
    found = []
    for key, kind in _SO_KINDS.items():
        given = value.get(key)
        if given is None or (key == "json_object" and given is False):
            continue
        where = f"structured_outputs.{key}"
        if key == "json_object" and given is not True:
            raise InvalidParams(where, "must be a boolean")
        found.append(Constraint(where, StructuredOutput("json_object") if key == "json_object" else
                                spec_of(kind, given, where)))  # fmt: skip
    if not found:
        raise InvalidParams("structured_outputs", f"must set one of {list(_SO_KINDS)}")
    return only_one(found)


# ------------------------------------------------------------------------------------------------- LightLLM


def lightllm_constraint(parameters: dict) -> Constraint | None:
    """LightLLM's /generate constraint parameters; null, false and "" (its default) ask for nothing."""
    found = []
    for name, kind in LIGHTLLM_KINDS.items():
        value = parameters.get(name)
        if value is None or value is False or value == "":
            continue
        where = f"parameters.{name}"
        if name == "guided_grammar" and value == "json":  # LightLLM's own spelling of json_object
            found.append(Constraint(where, StructuredOutput("json_object")))
        else:
            found.append(Constraint(where, spec_of(kind, value, where)))
    return only_one(found)


# ------------------------------------------------------------------------------------------------- shared


def only_one(found: list[Constraint]) -> Constraint | None:
    if len(found) > 1:
        raise InvalidParams(found[1].field, f"one output constraint per request: {found[0].field} is given too")
    return found[0] if found else None


def spec_of(kind: str, value: object, where: str) -> StructuredOutput:
    """A constraint's value as the client sent it -> StructuredOutput (its spec as text)."""
    if kind == "json":
        if isinstance(value, str):
            value = _json_text(value, where)
        if not isinstance(value, (dict, bool)):
            raise InvalidParams(where, "must be a JSON schema (an object)")
        spec = json.dumps(value, ensure_ascii=False)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidParams(where, "must be a non-empty list of strings")
        spec = json.dumps(value, ensure_ascii=False)
    elif kind == "structural_tag":
        spec = json.dumps(_structural_tag(_json_text(value, where) if isinstance(value, str) else value, where))
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise InvalidParams(where, "must be a non-empty string")
        spec = value
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise InvalidParams(where, f"is longer than {MAX_CONSTRAINT_CHARS} characters")
    return StructuredOutput(kind, spec)


def _structural_tag(value: object, where: str) -> dict:
    """xgrammar's structural tag ({"format": ...}), or vLLM's older {"structures": [{begin, schema, end}],
    "triggers": [...]} rewritten into it (a triggered_tags format)."""
    if not isinstance(value, dict):
        raise InvalidParams(where, "must be an object: {format} or {structures, triggers}")
    if "format" in value:
        return {**value, "type": "structural_tag"}
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise InvalidParams(f"{where}.structures", "must be a list of {begin, schema, end}")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidParams(f"{where}.triggers", "must be a list of non-empty strings")
    tags = [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
             "content": {"type": "json_schema", "json_schema": s.get("schema")}} for s in structures]  # fmt: skip
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def _json_text(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidParams(where, f"is not valid JSON: {e}") from None


def _no_other_keys(value: dict, allowed: set | frozenset, where: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidParams(f"{where}.{key}", "unknown or unsupported field")


def with_constraint(params: SamplingParams, constraint: Constraint | None, prefix: str = "") -> SamplingParams:
    """`params` constrained (None: unchanged). The spec is compiled first, so that a bad one is refused here; a
    token-id allow-list would fight the grammar's own mask, so the two are refused together (as LightLLM does)."""
    if constraint is None:
        return params
    if params.allowed_token_ids is not None:
        raise InvalidParams(f"{prefix}allowed_token_ids", f"cannot be combined with {constraint.field}")
    error = COMPILED.error(constraint.output)
    if error is not None:
        raise InvalidParams(constraint.field, error)
    return replace(params, structured=constraint.output)


def lightllm_field(field: str, output: StructuredOutput | None) -> str:
    """The engine names its compile error `parameters.structured`: /generate's client hears the parameter it sent
    (json_object comes from guided_grammar "json")."""
    if output is None or field != "parameters.structured":
        return field
    name = {kind: name for name, kind in LIGHTLLM_KINDS.items()}.get(output.kind, "guided_grammar")
    return f"parameters.{name}"


# ------------------------------------------------------------------------------------------------- compiling

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_MESSAGE = 400  # xgrammar quotes the whole JSON text it failed to parse


def compile_error(output: StructuredOutput) -> str | None:
    """Why xgrammar cannot build a grammar for `output` (its message, trimmed), or None. No tokenizer is needed:
    what fails here fails in the engine too."""
    try:
        if output.kind == "json":
            xgrammar.Grammar.from_json_schema(output.spec)
        elif output.kind == "regex":
            xgrammar.Grammar.from_regex(output.spec)
        elif output.kind == "grammar":
            xgrammar.Grammar.from_ebnf(output.spec)
        elif output.kind == "structural_tag":
            xgrammar.Grammar.from_structural_tag(output.spec)
    except Exception as e:  # RuntimeError, InvalidJSONError, InvalidStructuralTagError, pydantic's ValidationError
        message = _XGRAMMAR_PREFIX.sub("", str(e).strip())
        return message[:_MAX_MESSAGE] + (" ..." if len(message) > _MAX_MESSAGE else "")
    return None  # json_object and choice always compile


class CompileCache:
    """compile_error by (kind, digest of spec), least recently used first out: a service that sends the same few
    schemas again and again compiles each once; the specs themselves (up to 1 MiB each) are not kept."""

    def __init__(self, size: int = 512):
        self.size = size
        self._results: OrderedDict[tuple[str, bytes], str | None] = OrderedDict()
        self._lock = threading.Lock()  # the tokenizer pool's threads share it

    def error(self, output: StructuredOutput) -> str | None:
        key = (output.kind, hashlib.blake2b(output.spec.encode(), digest_size=16).digest())
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
        result = compile_error(output)  # outside the lock: two threads may compile the same spec once each
        with self._lock:
            self._results[key] = result
            while len(self._results) > self.size:
                self._results.popitem(last=False)
        return result

    def __len__(self) -> int:
        return len(self._results)


COMPILED = CompileCache()
