"""The tool-call parser (Qwen's `<tool_call>` format) and the reasoning parser (Qwen3's `<think>`): what a whole
output parses to, and that the same output streamed in two pieces, split at every character, gives deltas that
join to that same message (content, reasoning, each call's name and arguments), OpenAI-shaped, with no markup in the
content."""

from __future__ import annotations

import pytest

from mmserve.http.chat_output import ChatOutputPlan, chat_message, finish_reason, output_plan
from mmserve.http.reasoning_parsers import Qwen3ReasoningParser
from mmserve.http.tool_parsers import QwenToolCallParser

TOOLS = ChatOutputPlan(tool_call_parser="qwen25")
BOTH = ChatOutputPlan(tool_call_parser="qwen25", reasoning_parser="qwen3")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}\n</tool_call>'
WEATHER_ARGS = '{"city": "Paris", "days": [1, {"x": "}"}]}'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

# (output, plan, content, reasoning, [(name, arguments)])
CASES = [
    ("Just text.", TOOLS, "Just text.", None, []),
    ("  spaced  ", TOOLS, "  spaced  ", None, []),
    (WEATHER, TOOLS, None, None, [("get_weather", WEATHER_ARGS)]),
    ("Let me look.\n" + WEATHER, TOOLS, "Let me look.\n", None, [("get_weather", WEATHER_ARGS)]),
    (WEATHER + "\n" + TIME + "\n", TOOLS, None, None, [("get_weather", WEATHER_ARGS), ("get_time", "{}")]),
    (WEATHER + "\nDone.", TOOLS, "Done.", None, [("get_weather", WEATHER_ARGS)]),
    # another key order: announced when the block closes, arguments re-serialised
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', TOOLS, None, None, [("f", '{"a": 1}')]),
    ("<tool_call>not json</tool_call> tail", TOOLS, "<tool_call>not json</tool_call> tail", None, []),
    # cut by max_tokens inside the arguments: the call with what was written
    ('<tool_call>\n{"name": "f", "arguments": {"a": "unfini', TOOLS, None, None, [("f", '{"a": "unfini')]),
    ("a < b <tool_c", TOOLS, "a < b <tool_c", None, []),
    ("<think>\nPonder.\n</think>\n\nAnswer.", BOTH, "Answer.", "\nPonder.\n", []),
    ("<think>Hmm</think>\n\n" + WEATHER, BOTH, None, "Hmm", [("get_weather", WEATHER_ARGS)]),
    ("<think>cut short", BOTH, None, "cut short", []),
    ("No thinking here </think> x", ChatOutputPlan(reasoning_parser="qwen3"), "No thinking here </think> x", None,
     []),
    ("<thin", ChatOutputPlan(reasoning_parser="qwen3"), "<thin", None, []),
    ("already thinking</think>The answer", ChatOutputPlan(reasoning_parser="qwen3", thinking_opened=True),
     "The answer", "already thinking", []),
]  # fmt: skip


def streamed(text: str, plan: ChatOutputPlan, cut: int) -> tuple[str | None, str | None, list, list[dict]]:
    stream = plan.stream()
    deltas = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
    calls: list[list[str]] = []
    for delta in deltas:
        assert len(delta) == 1 and all(delta.values()), delta  # one kind per delta, never empty
        for piece in delta.get("tool_calls", ()):
            if "id" in piece:  # a call's first delta: index, id, type, name; arguments follow
                assert piece["index"] == len(calls) and piece["type"] == "function" and piece["id"].startswith("call_")
                assert piece["function"]["arguments"] == ""
                calls.append([piece["function"]["name"], ""])
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                calls[piece["index"]][1] += piece["function"]["arguments"]
    return content, reasoning, [tuple(c) for c in calls], deltas


@pytest.mark.parametrize("text, plan, content, reasoning, calls", CASES)
def test_whole_output(text, plan, content, reasoning, calls):
    message, called = chat_message(text, plan)
    assert message["content"] == content or (content is None and message["content"] == "" and not calls)
    assert message.get("reasoning_content") == reasoning
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert got == calls and called == bool(calls)
    for call in message.get("tool_calls", []):
        assert call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize("text, plan, content, reasoning, calls", CASES)
def test_streamed_at_every_split_joins_to_the_whole(text, plan, content, reasoning, calls):
    for cut in range(len(text) + 1):
        got_content, got_reasoning, got_calls, deltas = streamed(text, plan, cut)
        assert (got_content, got_reasoning, got_calls) == (content, reasoning, calls), cut
        if calls:
            assert not any("<tool_call>" in d.get("content", "") for d in deltas)


def test_deltas_stream_as_text_arrives():
    """Text before a call streams before the call closes; the name comes before the arguments are complete."""
    parser = QwenToolCallParser()
    assert parser.feed("Sure") == [{"content": "Sure"}]
    assert parser.feed(", <tool_") == [{"content": ", "}]  # the partial tag is held back
    first = parser.feed('call>\n{"name": "f", "arguments": {"a": ')
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"a":'}  # whitespace: maybe the end
    assert parser.feed("1}") == [{"tool_calls": [{"index": 0, "function": {"arguments": " 1"}}]}]  # `}` may close it
    assert parser.feed("}\n</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert parser.finish() == []


def test_parallel_false_keeps_the_first_call():
    message, _ = chat_message(WEATHER + TIME, ChatOutputPlan(tool_call_parser="qwen25", parallel_tool_calls=False))
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_reasoning_parser_alone_streams_reasoning_first():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>a</th") == ("a", "")
    assert parser.feed("ink>\n\nb") == ("", "b")


def test_output_plan_follows_the_request():
    assert output_plan({"tools": [{}], "tool_choice": "none"}, "", "qwen25", None).tool_call_parser is None
    assert output_plan({"tools": [{}]}, "", "qwen25", None).tool_call_parser == "qwen25"
    assert output_plan({}, "", "qwen25", None).tool_call_parser is None
    assert not output_plan({"tools": [{}], "parallel_tool_calls": False}, "", "qwen25", None).parallel_tool_calls
    assert output_plan({}, "<|im_start|>assistant\n<think>\n", None, "qwen3").thinking_opened
    assert not output_plan({}, "<|im_start|>assistant\n", None, "qwen3").thinking_opened
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length" and finish_reason(None, True) is None
