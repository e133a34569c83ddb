"""Schema fuzzing through the real server (tiny random Llama): bodies drawn from the request schemas the server
publishes at /openapi.json, valid and then mutated (wrong types, huge integers, NaN and infinities, lone
surrogates, deep nesting, unknown keys, broken bytes), on every POST route. Each answer must be a 2xx or a 4xx JSON
error (never a 5xx, never JSON that is not strict JSON); afterwards the server is healthy, holds no request and no KV
slot, and answers a normal request. Bounded: a fixed number of derandomized examples, small token budgets."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmserve.testing.server_proc import ServerProcess, serving

POST_ROUTES = ["/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"]
TOKEN_BUDGETS = {"max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens"}
# A template that renders any messages the parser accepts (the demo checkpoint has none): chat bodies reach the engine.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text if p.type == 'text' else '<image>' }}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    srv = ServerProcess(e2e_model_dir, str(folder / "server.log"), "--max_total_token_num", "2048",
                        "--max_req_total_len", "256", "--chat_template", str(folder / "chat.jinja"))  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def body_schemas(server) -> dict[str, dict]:
    paths = httpx.get(server.url + "/openapi.json", timeout=10).json()["paths"]
    return {path: paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"] for path in POST_ROUTES}


# ------------------------------------------------------------------------------------------------- schema -> data


def from_schema(schema: dict, name: str = "") -> st.SearchStrategy:
    """Values valid under `schema` (the subset of JSON Schema that mmserve/http/openapi.py writes)."""
    if name in TOKEN_BUDGETS:
        return st.integers(0 if name == "min_new_tokens" else 1, 3)  # keeps each request to a few steps
    if "anyOf" in schema:
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        return st.one_of([from_schema(_merge(rest, alt), name) for alt in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":  # FastAPI writes the bounds as floats (0.0): back to exact integers
        low, high = _int(schema.get("minimum")), _int(schema.get("maximum"))
        if "exclusiveMaximum" in schema:
            high = _int(schema["exclusiveMaximum"]) - 1
        edges = [v for v in (low, high, 2**31, 2**63 - 1, 2**63, 2**64) if v is not None and _within(v, low, high)]
        return st.integers(low, high) | st.sampled_from(edges)  # the edges of the engine's dtypes too
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "string" or "pattern" in schema:
        pattern = schema.get("pattern")
        if pattern:
            return st.from_regex(pattern, fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=24)
    if kind == "array":
        return _array(schema)
    if kind == "object" or "properties" in schema:
        return _object(schema)
    return JSON_VALUES


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _within(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _merge(base: dict, alt: dict) -> dict:
    required = base.get("required", []) + alt.get("required", [])
    return {**base, **alt, **({"required": required} if required else {})}


def _array(schema: dict) -> st.SearchStrategy:
    if "prefixItems" in schema:
        return st.tuples(*(from_schema(s) for s in schema["prefixItems"])).map(list)
    items = from_schema(schema.get("items", {}))
    return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))


def _object(schema: dict) -> st.SearchStrategy:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    if props:
        fixed = {k: from_schema(v, k) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, k) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional)
    keys = from_schema(schema["propertyNames"]) if "propertyNames" in schema else st.text(max_size=8)
    values = schema.get("additionalProperties")
    return st.dictionaries(keys, from_schema(values) if isinstance(values, dict) else JSON_VALUES, max_size=3)


# ------------------------------------------------------------------------------------------------- mutations

HOSTILE_SCALARS = st.sampled_from([
    2**64, -(2**64), 2**63, 2**31, -1, 0, 10**400, 1e308, -1e308, 5e-324, -0.0, math.nan, math.inf, -math.inf,
    "NaN", "Infinity", "-1", "1e999", "", "\ud800", "x\udfffy", None, True, False, [], {}, [[[]]], {"": None},
])  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | HOSTILE_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON value, as key/index paths."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value, path: tuple, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    return [_replace(v, rest, new) if i == head else v for i, v in enumerate(value)]


@st.composite
def mutated(draw, valid: st.SearchStrategy) -> bytes:
    """A valid body, or one with a few of its places given hostile values, unknown keys or lone surrogates; or the
    body's bytes broken (cut short, deep nesting around it, invalid UTF-8)."""
    body = draw(valid)
    for _ in range(draw(st.integers(0, 3))):
        body = _mutate(draw, body)
    raw = json.dumps(_bounded(body)).encode()  # NaN and infinities as Python writes them: NaN, Infinity
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "nest", "bytes"]))
    if damage == "cut":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif damage == "nest":
        depth = draw(st.sampled_from([50, 999, 3000, 100_000]))
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}" if raw.endswith(b"}") else raw
    elif damage == "bytes":
        raw = raw.replace(b'"', b'"\xff\xed\xa0\x80', 1)
    return raw


def _mutate(draw, body):
    path = draw(st.sampled_from(_paths(body)))
    how = draw(st.sampled_from(["value", "unknown_key", "surrogate"]))
    if how == "value":
        return _replace(body, path, draw(JSON_VALUES))
    if how == "surrogate":
        return _replace(body, path, draw(st.sampled_from(["\ud800", "a\udc00b", "\udfff" * 3])))
    target = body
    for step in path:
        target = target[step]
    if not isinstance(target, dict):
        return body
    return _replace(body, path, {**target, draw(st.text(min_size=1, max_size=8)): draw(JSON_VALUES)})


def _bounded(body):
    """A body whose mutations dropped its token budget gets a small one back: a chat without max_tokens fills the
    context, which takes seconds per request on a contended CPU and tests nothing more."""
    if not isinstance(body, dict):
        return body
    if "messages" in body or "prompt" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            return {**body, "max_tokens": 2}
    elif isinstance(body.get("parameters"), dict) and "max_new_tokens" not in body["parameters"]:
        return {**body, "parameters": {**body["parameters"], "max_new_tokens": 2}}
    return body


# ------------------------------------------------------------------------------------------------- checks


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_answer(path: str, raw: bytes, r: httpx.Response) -> None:
    what = f"{path} {raw[:300]!r} -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, what
    kind = r.headers.get("content-type", "")
    if r.status_code >= 300 or kind.startswith("application/json"):
        assert kind.startswith("application/json"), what
        answer = _strict(r.content.decode("utf-8"))
        assert isinstance(answer, dict) and (r.status_code < 300 or "error" in answer), what
        return
    assert kind.startswith("text/event-stream"), what
    for line in r.text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            assert "error" not in _strict(line[5:]), what  # a stream's error event is a server failure


SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=SLOW_OK)
@given(data=st.data())
def test_fuzzed_bodies_get_2xx_or_a_4xx_json_error(server, body_schemas, data):
    path = data.draw(st.sampled_from(POST_ROUTES), label="route")
    raw = data.draw(mutated(from_schema(body_schemas[path])), label="body")
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    event(f"{path} {r.status_code}")  # the spread of answers: pytest --hypothesis-show-statistics
    check_answer(path, raw, r)


def test_after_the_fuzz_the_server_is_healthy_and_holds_nothing(server):
    r = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and r.json()["count_output_tokens"] >= 1, r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    assert not re.search(r"Traceback|Exception in ASGI", server.log()), server.log()[-4000:]
