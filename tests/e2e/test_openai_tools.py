"""Tool calls over real HTTP with the real `openai` client, on a tiny random Qwen3-VL whose published chat template
writes tools (`<tools>`, `<tool_call>`, `<tool_response>`), served with --tool_call_parser qwen25: a named or
"required" tool_choice yields parsed calls whose arguments validate against the tool's schema (random weights write
a valid call only through the grammar), streamed deltas join to the same call, "none" and `tool_choice: null` give
text, tool and developer turns reach the template, and a malformed tool gets a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl
from mmserve.testing.server_proc import ServerProcess, serving

MODEL = "qwen3_vl"
# Bounded values (an enum, a small integer): the grammar closes the call well inside max_tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}  # fmt: skip
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 200  # the tiny tokenizer writes a call in about 70 tokens
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_qwen3_vl(str(tmp_path_factory.mktemp("tools") / MODEL))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--tool_call_parser", "qwen25", "--reasoning_parser", "qwen3")  # fmt: skip
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_yields_that_call(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=NAMED,
                                           max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    check_calls(choice.message.tool_calls)
    assert choice.message.content is None


def test_required_yields_calls_of_the_tools_sampled_too(client):
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS,
                                               temperature=1.0, seed=seed)  # fmt: skip
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
        check_calls(calls)


def test_streamed_deltas_join_to_the_same_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content  # no markup leaks into the content
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:  # a call's first delta: its id, type and name
                assert piece.index not in calls and piece.type == "function"
                calls[piece.index] = {"name": piece.function.name, "arguments": piece.function.arguments or ""}
            else:
                assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"name": whole.function.name, "arguments": whole.function.arguments}]


def test_none_gives_text_without_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0)  # fmt: skip
    message = reply.choices[0].message
    assert not message.tool_calls and isinstance(message.content, str)
    assert message.model_extra["reasoning_content"] is None  # --reasoning_parser: no <think> block in this reply
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_null_tool_choice_without_tools_is_accepted(server):
    body = {"model": MODEL, "messages": ASK, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
            "max_tokens": 4}  # fmt: skip
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] is not None


def test_tool_and_developer_turns_pass_to_the_template(client):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 7}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny all week."},
    ]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert reply.usage.prompt_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "tools, tool_choice, param",
    [([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0].function.name"),
     ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto",
      "tools[1].function.parameters"),
     ([CLOCK], NAMED, "tool_choice.function.name")],
)  # fmt: skip
def test_malformed_tools_get_400_naming_the_field(client, tools, tool_choice, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice, max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert param in info.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices  # still serving
