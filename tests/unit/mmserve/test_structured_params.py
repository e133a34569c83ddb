"""Structured output fields -> SamplingParams.structured: OpenAI's response_format, vLLM's structured_outputs and
guided_*, LightLLM's /generate parameters. Each maps to one StructuredOutput; a malformed value, a spec xgrammar
cannot compile, or a second constraint gets a 400 naming the client's own field; compile results are cached."""

from __future__ import annotations

import json

import pytest

from language.sampling_params import StructuredOutput
from mmserve.http.openai_protocol import completion_inputs, openai_param, sampling_params
from mmserve.http.protocol import BadRequest, parse_parameters
from mmserve.http.structured import CompileCache, lightllm_field, openai_field
from mmserve.testing.checkpoints.tokenizer import build_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured(body: dict) -> StructuredOutput | None:
    return sampling_params(body, 16).structured


def refused(body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        sampling_params(body, 16)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body, wanted",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True,
                                                                     "description": "x"}}},
         StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_regex": "[a-c]{2}"}, StructuredOutput("regex", "[a-c]{2}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "x" | "y"'}, StructuredOutput("grammar", 'root ::= "x" | "y"')),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput("choice", '["x"]')),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutput("grammar", 'root ::= "x"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": None, "guided_json": None, "structured_outputs": None}, None),
    ],
)  # fmt: skip
def test_each_openai_and_vllm_field_maps_to_one_constraint(body, wanted):
    assert structured(body) == wanted


def test_completions_take_the_same_fields(tmp_path):
    tokenizer = build_tokenizer(str(tmp_path))
    body = {"prompt": ["Hi", "Ho"], "response_format": {"type": "json_object"}}
    inputs = completion_inputs(body, 100, tokenizer)
    assert [i.params.structured for i in inputs] == [StructuredOutput("json_object")] * 2  # every prompt's
    assert inputs[0].params.has_logit_masks  # the engine's masked path


def test_structural_tags_in_either_shape_become_xgrammar_s():
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]}  # fmt: skip
    spec = json.loads(structured({"response_format": legacy}).spec)
    assert spec["type"] == "structural_tag" and spec["format"]["type"] == "triggered_tags"
    assert spec["format"]["tags"][0]["content"] == {"type": "json_schema", "json_schema": SCHEMA}
    fmt = {"format": {"type": "const_string", "value": "ok"}}
    so = structured({"structured_outputs": {"structural_tag": json.dumps(fmt)}})
    assert so.kind == "structural_tag" and json.loads(so.spec) == {**fmt, "type": "structural_tag"}


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"response_format": "json"}, "response_format", "object"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
         "response_format.json_schema.schema", "JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "non-empty string"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": 1}}},
         "response_format.json_schema.strict", "boolean"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "x": 1}}},
         "response_format.json_schema.x", "unknown"),
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", "unknown"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
         "response_format.json_schema.schema", "Unsupported type"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "minimum greater"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", 'Rule "x" is not defined'),
        ({"structured_outputs": {}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "one output"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "unknown"),
        ({"structured_outputs": {"grammar": "root ::= y"}}, "structured_outputs.grammar", "not defined"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
         "not supported"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "response_format"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "guided_json"),
        ({"guided_regex": "a", "allowed_token_ids": [1, 2]}, "allowed_token_ids", "guided_regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format",
         "not recognized"),
        ({"response_format": {"type": "structural_tag", "structures": {}, "triggers": []}},
         "response_format.structures", "list"),
    ],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_client_s_field(body, field, words):
    e = refused(body)
    assert e.field == field and words in e.message, (e.field, e.message)
    param, message = openai_param(e, body, "messages")
    assert param == field and message.startswith(f"{field}: ")


def test_xgrammar_s_source_location_is_cut_from_the_message():
    message = refused({"guided_regex": "(ab"}).message
    assert "/project" not in message and not message.startswith("[")


def test_the_engine_s_compile_error_names_the_client_s_field():
    engine = BadRequest("parameters.structured", "cannot compile")
    for body, field in [
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ]:  # fmt: skip
        assert openai_field(body) == (None if field == "tools" else field)
        assert openai_param(engine, body, "messages") == (field, f"{field}: cannot compile")
    for kind, name in [("json", "guided_json"), ("regex", "regular_constraint"), ("grammar", "guided_grammar"),
                       ("json_object", "guided_grammar")]:  # fmt: skip
        assert lightllm_field("parameters.structured", StructuredOutput(kind, "")) == f"parameters.{name}"
    assert lightllm_field("parameters.n", StructuredOutput("json", "")) == "parameters.n"
    assert lightllm_field("parameters.structured", None) == "parameters.structured"


@pytest.mark.parametrize(
    "parameters, field, words",
    [
        ({"guided_json": {"type": "foo"}}, "parameters.guided_json", "Unsupported type"),
        ({"guided_json": 3}, "parameters.guided_json", "JSON schema"),
        ({"regular_constraint": "[a-"}, "parameters.regular_constraint", "Unclosed"),
        ({"guided_grammar": "nothing"}, "parameters.guided_grammar", "root"),
        ({"guided_json": SCHEMA, "regular_constraint": "a"}, "parameters.regular_constraint", "guided_json"),
        ({"guided_grammar": "json", "allowed_token_ids": [1, 2]}, "parameters.allowed_token_ids", "guided_grammar"),
        ({"guided_json": SCHEMA, "n": 0}, "parameters.n", ""),  # the sampling fields are checked as before
    ],
)  # fmt: skip
def test_lightllm_constraint_errors_name_the_parameter(parameters, field, words):
    with pytest.raises(BadRequest) as info:
        parse_parameters(parameters)
    assert info.value.field == field and words in info.value.message, info.value


def test_lightllm_guided_json_takes_a_schema_or_its_text():
    as_object = parse_parameters({"guided_json": SCHEMA}).structured
    assert as_object == parse_parameters({"guided_json": json.dumps(SCHEMA)}).structured
    assert as_object == StructuredOutput("json", json.dumps(SCHEMA))


def test_compile_results_are_cached_by_spec_and_bounded():
    cache = CompileCache(size=2)
    good, bad = StructuredOutput("regex", "a+"), StructuredOutput("regex", "(")
    assert cache.error(good) is None and "parenthesis" in cache.error(bad)
    assert len(cache) == 2
    assert cache.error(StructuredOutput("grammar", "root ::= z")) is not None
    assert len(cache) == 2  # the least recently used one went out
    assert cache.error(bad) == cache.error(bad)
