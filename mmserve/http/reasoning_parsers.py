"""Reasoning out of generated text, in Qwen3's format (`--reasoning_parser qwen3`): `<think>reasoning</think>answer`.
The reasoning goes to the message's `reasoning_content` (vLLM's and SGLang's field), the answer to `content`.

A thinking model's template may open the block itself (the prompt ends with `<think>`): then the output starts inside
it. Otherwise the block counts only where the output begins with `<think>`; an output that never closes its block is
all reasoning (cut by max_tokens while thinking). Like the tool-call parser, it is incremental: a non-streamed reply
is the whole text fed at once, so streamed deltas join to the non-streamed message."""

from __future__ import annotations

from mmserve.http.tool_parsers import held_tag_prefix

THINK_START, THINK_END = "<think>", "</think>"

_BEFORE, _THINKING, _ANSWER = "before", "thinking", "answer"


def prompt_opens_thinking(prompt: str) -> bool:
    """The template opened the block: the generation prompt ends with `<think>` (and whitespace)."""
    return prompt.rstrip().endswith(THINK_START)


class Qwen3ReasoningParser:
    """feed(text) -> (reasoning, answer) settled by the text so far; finish() -> what was held at the end."""

    def __init__(self, opened: bool = False):
        self.state = _THINKING if opened else _BEFORE
        self.buffer = ""
        self.answer_started = False  # the whitespace after </think> is not the answer's

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = answer = ""
        if self.state == _BEFORE:
            start = self.buffer.lstrip()
            if start.startswith(THINK_START):
                self.state, self.buffer = _THINKING, start[len(THINK_START) :]
            elif THINK_START.startswith(start):
                return "", ""  # maybe the block's start, still arriving
            else:
                self.state = _ANSWER
                self.answer_started = True  # no block: the text is the model's answer as written
        if self.state == _THINKING:
            at = self.buffer.find(THINK_END)
            if at < 0:
                settled = len(self.buffer) - held_tag_prefix(self.buffer, THINK_END)
                reasoning, self.buffer = self.buffer[:settled], self.buffer[settled:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(THINK_END) :]
            self.state = _ANSWER
        answer, self.buffer = self._answer(self.buffer), ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        held, self.buffer = self.buffer, ""
        if self.state == _THINKING:
            return held, ""
        return "", held if self.state == _BEFORE else self._answer(held)

    def _answer(self, text: str) -> str:
        if not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        return text


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
