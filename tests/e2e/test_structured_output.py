"""Structured output (issue 28) over real HTTP with the real `openai` client, on the tiny random Qwen2-VL demo
checkpoint: random weights write valid JSON for a schema, a regex, a choice or a grammar only through the grammar's
token mask. json_schema outputs parse and validate (jsonschema) for twelve schemas, greedy and sampled, with and
without an image, streamed with n > 1 too; json_object, vLLM's guided_* and structured_outputs, LightLLM's /generate
names; {"type": "text"} changes nothing; a bad constraint, or one grown too slow to match, gets a 400 naming the
client's field, and the server keeps serving."""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from mmserve.testing.checkpoints.qwen2_vl_demo import build_qwen2_vl_demo
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving

MODEL = "qwen2vl"
MAX_TOKENS = 160  # each schema's longest answer fits: a cut answer would not parse
IMAGE_URL = "data:image/png;base64," + png_b64(picture(96, 64, 5))

# Bounded schemas: every string has a maxLength, enum or pattern, every number is a bounded integer, every array a
# maxItems, so that any path through the grammar closes well within MAX_TOKENS.
SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "integers": {"type": "object", "required": ["age", "level"], "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "level": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "short_string": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6}},
                     "required": ["name"]},
    "array": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}},
    "nested": {"type": "object", "required": ["point"], "properties": {"point": {
        "type": "object", "required": ["x", "y"],
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                       "y": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
    "any_of": {"type": "object", "required": ["value"], "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"type": "null"}]}}},
    "booleans": {"type": "object", "required": ["ok", "done"],
                 "properties": {"ok": {"type": "boolean"}, "done": {"type": "boolean"}}},
    "optional": {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9}, "note": {"type": "string", "maxLength": 4}}},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                        "maxItems": 4},
    "const_and_pattern": {"type": "object", "required": ["kind", "code"], "properties": {
        "kind": {"const": "receipt"}, "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}},
    "ref": {"type": "object", "required": ["items"],
            "$defs": {"item": {"type": "object", "required": ["qty"],
                               "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}}},
    "receipt": {"type": "object", "required": ["total_cents", "currency", "paid"], "properties": {
        "total_cents": {"type": "integer", "minimum": 0, "maximum": 99999}, "currency": {"enum": ["USD", "EUR"]},
        "paid": {"type": "boolean"}}},
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("structured") / MODEL)
    os.makedirs(path)
    build_qwen2_vl_demo(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    with serving(ServerProcess(model_dir, log, "--max_total_token_num", "8192", "--enable_multimodal")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def messages(text: str, image: bool = False) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": IMAGE_URL}}] if image else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_json_schema_outputs_validate_greedy_and_sampled_with_and_without_an_image(client):
    cases = [(name, sampled, image) for name in SCHEMAS for sampled in (False, True) for image in (False, True)]

    def ask(case):
        name, sampled, image = case
        sampling = {"temperature": 1.0, "seed": 11} if sampled else {"temperature": 0}
        return client.chat.completions.create(
            model=MODEL, messages=messages(f"Describe it as JSON ({name}).", image), max_tokens=MAX_TOKENS,
            response_format=json_schema_format(name), **sampling)  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, cases))
    for (name, sampled, image), reply in zip(cases, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (name, sampled, image, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    greedy = {(n, i): r.choices[0].message.content for (n, s, i), r in zip(cases, replies, strict=True) if not s}
    sampled = {(n, i): r.choices[0].message.content for (n, s, i), r in zip(cases, replies, strict=True) if s}
    assert greedy != sampled  # sampling took other paths through the grammars


def test_streamed_n_choices_each_follow_the_schema(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=messages("Two receipts.", image=True), max_tokens=MAX_TOKENS, n=3, stream=True,
        temperature=1.0, seed=3, response_format=json_schema_format("receipt"))  # fmt: skip
    texts, finish = defaultdict(str), {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMAS["receipt"])


def test_json_object_is_an_object_on_both_routes(client):
    reply = client.chat.completions.create(model=MODEL, messages=messages("JSON please."), max_tokens=MAX_TOKENS,
                                           response_format={"type": "json_object"}, temperature=0)  # fmt: skip
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    done = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=MAX_TOKENS, seed=1, temperature=1,
                                     extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)


def test_completions_follow_a_json_schema(client):
    done = client.completions.create(
        model=MODEL, prompt="A point:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": json_schema_format("nested")})  # fmt: skip
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS["nested"])


def test_vllm_guided_fields_and_structured_outputs(client):
    regex = r"[A-Z][a-z]{1,4}-[0-9]{2}"
    done = client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, temperature=1, seed=2,
                                     extra_body={"guided_regex": regex})  # fmt: skip
    assert re.fullmatch(regex, done.choices[0].text), done.choices[0].text
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages("Sentiment?", image=seed == 0), max_tokens=20, temperature=1, seed=seed,
            extra_body={"guided_choice": choices})  # fmt: skip
        assert reply.choices[0].message.content in choices
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]? [a-z]?'
    reply = client.chat.completions.create(model=MODEL, messages=messages("Greet."), max_tokens=30, temperature=1,
                                           seed=4, extra_body={"guided_grammar": grammar})  # fmt: skip
    assert re.fullmatch(r"(hello|hi) [a-z]{1,3}", reply.choices[0].message.content), reply.choices[0].message.content
    vllm = {"structured_outputs": {"choice": ["yes", "no"]}, "guided_decoding_backend": "xgrammar"}
    reply = client.chat.completions.create(model=MODEL, messages=messages("Yes or no?"), max_tokens=20, temperature=0,
                                           extra_body=vllm)  # fmt: skip
    assert reply.choices[0].message.content in ("yes", "no")
    reply = client.chat.completions.create(
        model=MODEL, messages=messages("Flags."), max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"guided_json": SCHEMAS["booleans"]})  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS["booleans"])


def test_text_format_is_accepted_and_changes_nothing(client):
    def ask(**extra):
        reply = client.chat.completions.create(model=MODEL, messages=messages("Hello", image=True), max_tokens=10,
                                               temperature=0, logprobs=True, **extra)  # fmt: skip
        return [t.token for t in reply.choices[0].logprobs.content]

    plain = ask()
    assert ask(response_format={"type": "text"}) == plain
    assert len(plain) == 10


@pytest.mark.parametrize(
    "extra, param, reason",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format.json_schema.schema", "Unsupported type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of"),
        ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "minimum greater"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "Unclosed"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one output constraint"),
    ],
)  # fmt: skip
def test_bad_constraints_get_a_400_naming_the_field_and_the_server_keeps_serving(client, server, extra, param, reason):
    before = server.metrics()["mmserve_requests_total"]
    e = error_of(lambda: client.chat.completions.create(model=MODEL, messages=messages("x"), max_tokens=4,
                                                        extra_body=extra))  # fmt: skip
    error = e.response.json()["error"]
    assert e.status_code == 400 and error["param"] == param and error["message"].startswith(param), error
    assert reason in error["message"], error
    assert server.metrics()["mmserve_requests_total"] == before  # refused before anything was queued
    reply = client.chat.completions.create(model=MODEL, messages=messages("x"), max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_a_constraint_grown_too_slow_ends_its_request_and_the_server_keeps_serving(client, server, model_dir):
    """An ambiguous regex, and a logit bias that keeps the model on "a": the matcher's work grows with every token
    until one mask takes longer than the engine allows (language/structured.py), and the request ends there, long
    before its max_tokens, with the error naming the client's field: a 400 unstreamed, an error event streamed (the
    openai client raises it), on /generate_stream too. The server keeps serving."""
    a = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("a")
    extra = {"guided_regex": r"((a|aa|aaa)*(a|aa)*)*b"}
    create = functools.partial(client.chat.completions.create, model=MODEL, messages=messages("x"), max_tokens=3000,
                               logit_bias={str(a): 100}, extra_body=extra)  # fmt: skip
    e = error_of(create)
    error = e.response.json()["error"]
    assert e.status_code == 400 and error["param"] == "guided_regex" and "too slow" in error["message"], error
    with pytest.raises(openai.APIError, match="too slow"):
        for _ in create(stream=True):
            pass
    parameters = {"regular_constraint": extra["guided_regex"], "logit_bias": {str(a): 100}, "max_new_tokens": 3000}
    body = {"inputs": "x", "parameters": parameters}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=300) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert 20 < len(events) < 3000 and events[-1]["finish_reason"] == "error", events[-1]
    assert events[-1]["error"].startswith("parameters.regular_constraint: the constraint grew too slow")
    reply = client.chat.completions.create(model=MODEL, messages=messages("x"), max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)


def generate(server, route: str, **parameters) -> httpx.Response:
    body = {"inputs": "<|im_start|>user\nJSON<|im_end|>\n<|im_start|>assistant\n", "parameters": parameters}
    return httpx.post(server.url + route, json=body, timeout=300)


def test_lightllm_generate_names(server):
    schema = SCHEMAS["integers"]
    for guided_json in (schema, json.dumps(schema)):  # LightLLM takes the schema's text; an object works too
        r = generate(server, "/generate", guided_json=guided_json, max_new_tokens=MAX_TOKENS, do_sample=True, seed=5)
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["generated_text"][0]), schema)
    r = generate(server, "/generate", regular_constraint="[0-9]{3}-[a-z]{2}", max_new_tokens=20)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["generated_text"][0]), r.text
    r = generate(server, "/generate", guided_grammar="json", max_new_tokens=MAX_TOKENS, do_sample=True, seed=6)
    assert isinstance(json.loads(r.json()["generated_text"][0]), dict), r.text  # LightLLM's json_object
    r = generate(server, "/generate", guided_json=SCHEMAS["enum"], max_new_tokens=MAX_TOKENS, n=2, do_sample=True)
    assert all(json.loads(t)["color"] in ("red", "green", "blue") for t in r.json()["generated_text"]), r.text
    body = {"inputs": "JSON:", "parameters": {"guided_json": SCHEMAS["booleans"], "max_new_tokens": MAX_TOKENS}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=300) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(events[-1]["generated_text"]), SCHEMAS["booleans"])
    for parameters, field, reason in [
        ({"guided_json": {"type": "foo"}}, "parameters.guided_json", "Unsupported type"),
        ({"regular_constraint": "[z-a]"}, "parameters.regular_constraint", "lower bound is larger"),
        ({"guided_grammar": "root ::= nothing"}, "parameters.guided_grammar", "not defined"),
        ({"guided_grammar": "json", "allowed_token_ids": [1, 2]}, "parameters.allowed_token_ids", "guided_grammar"),
    ]:
        r = generate(server, "/generate", **parameters)
        assert r.status_code == 400 and r.json()["field"] == field and reason in r.json()["error"], r.text
