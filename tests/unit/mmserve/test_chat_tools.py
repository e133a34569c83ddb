"""A chat request's tools -> what the server runs: the tools, tool results and earlier calls rendered by the
checkpoint's template (Qwen3-VL's published one); "required" and a named tool_choice become an output constraint
whose grammar accepts exactly the allowed calls with schema-valid arguments; malformed tools, choices and turns get a
400 naming the field."""

from __future__ import annotations

import json

import pytest
import xgrammar

from mmserve.http.chat_tools import tool_request
from mmserve.http.openai_protocol import OpenAIOptions, chat_input
from mmserve.http.protocol import BadRequest
from mmserve.prep.chat_templates import QWEN3_VL
from mmserve.testing.checkpoints.tokenizer import build_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARIS = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
QWEN = OpenAIOptions(tool_call_parser="qwen25")
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def chat(tokenizer, options=QWEN, **body):
    return chat_input({"messages": USER, **body}, tokenizer, QWEN3_VL, None, 64, options=options)


def test_tools_tool_turns_and_calls_reach_the_template(tokenizer):
    messages = [
        {"role": "developer", "content": "Answer in French."},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [PARIS]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": [WEATHER]}
    prompt = chat_input(body, tokenizer, QWEN3_VL, None, 64, options=QWEN).prompt
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nSunny, 25 C\n</tool_response><|im_end|>" in prompt
    assert chat(tokenizer, tools=[WEATHER]).params.structured is None  # "auto": the model decides


def test_custom_roles_pass_to_the_template(tokenizer):
    body = {"messages": [{"role": "critic", "content": "Be strict."}, *USER]}
    assert "<|im_start|>critic" not in chat_input(body, tokenizer, QWEN3_VL, None, 64).prompt  # the template skips it
    templated = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert chat_input(body, tokenizer, templated, None, 64).prompt == "[critic]Be strict.[user]Weather in Paris?"


def grammar_accepts(structured, text: str) -> bool:
    """Whether the constraint's grammar accepts `text` as a whole output (character level, no tokenizer)."""
    grammar = xgrammar.Grammar.from_structural_tag(structured.spec)
    matcher = xgrammar.testing._get_matcher_from_grammar(grammar)
    return matcher.accept_string(text) and matcher.is_terminated()


CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'


def test_named_choice_allows_only_that_call_with_valid_arguments(tokenizer):
    structured = chat(tokenizer, tools=[WEATHER, TIME], tool_choice=NAMED).params.structured
    assert structured.kind == "structural_tag"
    assert grammar_accepts(structured, CALL.format("get_weather", '{"city": "Paris"}'))
    assert not grammar_accepts(structured, CALL.format("get_weather", '{"town": "Paris"}'))  # not the schema
    assert not grammar_accepts(structured, CALL.format("get_time", "{}"))
    assert not grammar_accepts(structured, "Sure! " + CALL.format("get_weather", '{"city": "Paris"}'))


def test_required_allows_any_tool_but_no_text_alone(tokenizer):
    structured = chat(tokenizer, tools=[WEATHER, TIME], tool_choice="required").params.structured
    assert grammar_accepts(structured, CALL.format("get_time", "{}"))
    assert grammar_accepts(
        structured, CALL.format("get_time", "{}") + "\n" + CALL.format("get_weather", '{"city": "X"}')
    )
    assert not grammar_accepts(structured, "I will not call anything.")
    single = chat(tokenizer, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).params.structured
    assert not grammar_accepts(single, CALL.format("get_time", "{}") + "\n" + CALL.format("get_time", "{}"))


def test_none_auto_and_null_choices(tokenizer):
    bodies = [{"tool_choice": None}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []},
              {"tools": [WEATHER], "tool_choice": "none"}, {"tools": None, "tool_choice": None}]  # fmt: skip
    for body in bodies:
        assert chat(tokenizer, **body).params.structured is None, body
    assert "<tools>" in chat(tokenizer, tools=[WEATHER], tool_choice="none").prompt  # known, not to be called


@pytest.mark.parametrize(
    "body, field",
    [({"tools": {"a": 1}}, "tools"),
     ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
     ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
     ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}],
       "tool_choice": "required"}, "tools[0].function.parameters"),
     ({"tools": [WEATHER, TIME, WEATHER], "tool_choice": "required"}, "tools[2].function.name"),
     ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
     ({"tool_choice": "required"}, "tool_choice"),
     ({"tools": [TIME], "tool_choice": NAMED}, "tool_choice.function.name"),
     ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
     ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
     ({"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages[0].tool_call_id"),
     ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
      "messages[0].tool_calls[0].function.arguments"),
     ({"messages": [{"role": "assistant", "tool_calls": {"function": {}}}]}, "messages[0].tool_calls")],
)  # fmt: skip
def test_malformed_tool_fields_are_refused_by_name(tokenizer, body, field):
    with pytest.raises(BadRequest) as info:
        chat(tokenizer, **body)
    assert info.value.field == field


def test_a_forced_choice_needs_a_parser(tokenizer):
    with pytest.raises(BadRequest) as info:
        chat(tokenizer, options=OpenAIOptions(), tools=[WEATHER], tool_choice="required")
    assert info.value.field == "tool_choice" and "--tool_call_parser" in info.value.message
    assert tool_request({"tools": [WEATHER]}, None).choice == "auto"  # "auto" without a parser: rendered, not read
