"""A chat choice's generated text -> OpenAI's assistant message (non-streamed) or deltas (streamed): the reasoning
parser (--reasoning_parser) splits off `reasoning_content`, then the tool-call parser (--tool_call_parser, for a
request with tools and a tool_choice other than "none") reads the tool calls out of the rest. Both parsers are
incremental, and a non-streamed message is the same parsers fed the whole text: streamed deltas join to it."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.http.reasoning_parsers import REASONING_PARSERS, prompt_opens_thinking
from mmserve.http.tool_parsers import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ChatOutputPlan:
    """How one request's choices are parsed."""

    tool_call_parser: str | None = None  # None: the text is content (no tools, tool_choice "none", no parser)
    parallel_tool_calls: bool = True
    reasoning_parser: str | None = None
    thinking_opened: bool = False  # the prompt ends inside a reasoning block

    @property
    def parses(self) -> bool:
        return self.tool_call_parser is not None or self.reasoning_parser is not None

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


def output_plan(body: dict, prompt: str, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatOutputPlan:
    """The plan for a (validated) chat body rendered to `prompt`."""
    tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
    return ChatOutputPlan(
        tool_call_parser if tools else None,
        body.get("parallel_tool_calls") is not False,
        reasoning_parser,
        reasoning_parser is not None and prompt_opens_thinking(prompt),
    )


class ChatOutputStream:
    """One choice's parsers: feed(text) and finish() -> deltas ({"content"}, {"reasoning_content"} or
    {"tool_calls"}), consecutive text of one kind merged."""

    def __init__(self, plan: ChatOutputPlan):
        self.reasoning = None
        if plan.reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[plan.reasoning_parser](plan.thinking_opened)
        self.tools = None
        if plan.tool_call_parser is not None:
            self.tools = TOOL_CALL_PARSERS[plan.tool_call_parser](plan.parallel_tool_calls)
        self.called = False  # a tool call was announced: the choice's finish_reason is "tool_calls"

    def feed(self, text: str) -> list[dict]:
        return self._split(*self.reasoning.feed(text) if self.reasoning else ("", text), finish=False)

    def finish(self) -> list[dict]:
        return self._split(*self.reasoning.finish() if self.reasoning else ("", ""), finish=True)

    def _split(self, reasoning: str, answer: str, finish: bool) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is None:
            if answer:
                out.append({"content": answer})
            return out
        out += self.tools.feed(answer) if answer else []
        if finish:
            out += self.tools.finish()
        self.called = self.tools.calls > 0
        return out


def chat_message(text: str, plan: ChatOutputPlan) -> tuple[dict, bool]:
    """(the assistant message, whether it calls tools). content is null when the text went to reasoning or calls."""
    if not plan.parses:
        return {"role": "assistant", "content": text}, False
    stream = plan.stream()
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict] = []
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            if piece["index"] == len(calls):
                calls.append({"id": piece["id"], "type": "function", "function": dict(piece["function"])})
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    message: dict = {"role": "assistant", "content": content or (None if calls or reasoning else "")}
    if plan.reasoning_parser is not None:
        message["reasoning_content"] = reasoning or None
    if plan.tool_call_parser is not None:
        message["tool_calls"] = calls
    return message, bool(calls)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that calls tools and ends by itself finishes with "tool_calls", as OpenAI's; one cut short keeps
    "length" (its last call may be incomplete)."""
    return "tool_calls" if called and reason == "stop" else reason
