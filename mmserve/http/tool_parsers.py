"""Tool calls out of generated text, in the Qwen family's format (Qwen2.5, Qwen3, Qwen2.5-VL, Qwen3-VL; vLLM calls
it "hermes", LightLLM "qwen25"): one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks, with free text around them.

One incremental parser serves both answers: a non-streamed reply is the whole text fed at once, so a stream's deltas
always join to the non-streamed message. Its deltas are OpenAI's: {"content": text} for text outside the calls, and
for each call a first {"tool_calls": [{index, id, type, function: {name, arguments: ""}}]} followed by pieces of its
arguments' JSON text as they arrive. The `<tool_call>` markup never reaches the content.

How a block becomes a call: as soon as its text starts `{"name": "<name>", "arguments": `, the call is announced and
its arguments stream as written, less the object's closing brace; a block in another layout is announced when it
closes, if it parses as JSON with a name and arguments; a block that is neither stays in the content as text."""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

# The layout every Qwen template writes (and xgrammar's "qwen_3" structural tag enforces): the name, then the arguments
# as the object's last member. `(?=\S)`: the arguments start at their first character, however the text was split.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still close the call object: whitespace, its `}`, whitespace. Held back until text follows it.
_CALL_TAIL = re.compile(r"\s*\}?\s*$")


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag that may still be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class QwenToolCallParser:
    """Feed it the generated text piece by piece; each feed returns the OpenAI deltas that the text so far settles.
    parallel=False (the request's parallel_tool_calls: false) keeps the first call and drops any later block."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buffer = ""  # text not yet settled: a partial start tag, or the open block's body
        self.in_block = False
        self.calls = 0  # calls announced so far (the next call's index)
        # The current run of text outside the blocks, while it is only whitespace: held, and dropped if a block
        # follows it or a call came before it (the newlines around Qwen's blocks are not content).
        self.blank_run = ""
        self.run_has_text = False
        # The open block: announced as a call (its arguments start at args_start), how much of them is sent
        self.announced = False
        self.args_start = 0
        self.args_sent = 0
        self.discard = False

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while True:
            if not self.in_block:
                at = self.buffer.find(TOOL_CALL_START)
                if at < 0:
                    settled = len(self.buffer) - held_tag_prefix(self.buffer, TOOL_CALL_START)
                    self._outside(self.buffer[:settled], out)
                    self.buffer = self.buffer[settled:]
                    return out
                self._outside(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(TOOL_CALL_START) :]
                self._open_block()
            else:
                at = self.buffer.find(TOOL_CALL_END)
                if at < 0:
                    self._progress(self.buffer[: len(self.buffer) - held_tag_prefix(self.buffer, TOOL_CALL_END)], out)
                    return out
                self._close_block(self.buffer[:at], TOOL_CALL_END, out)
                self.buffer = self.buffer[at + len(TOOL_CALL_END) :]

    def finish(self) -> list[dict]:
        """The end of the output: an unclosed block is settled as if it had closed; held whitespace is content only
        in an answer without calls."""
        out: list[dict] = []
        if self.in_block:
            self._close_block(self.buffer, "", out)
        else:
            self._outside(self.buffer, out)
        self.buffer = ""
        if self.blank_run and self.calls == 0:
            _content(self.blank_run, out)
        self.blank_run = ""
        return out

    # ---------------------------------------------------------------------------------------------- outside blocks

    def _outside(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        if not self.run_has_text:
            text, self.blank_run = self.blank_run + text, ""
            if not text.strip():
                self.blank_run = text
                return
            if self.calls:  # the text after a call starts at its first word
                text = text.lstrip()
            self.run_has_text = True
        _content(text, out)

    # ---------------------------------------------------------------------------------------------- inside a block

    def _open_block(self) -> None:
        if not self.run_has_text:
            self.blank_run = ""
        self.in_block, self.announced, self.args_sent = True, False, 0
        self.discard = not self.parallel and self.calls > 0

    def _progress(self, body: str, out: list[dict]) -> None:
        """Announce the call once its head is written, then send the arguments written so far, less what may be
        the object's closing brace."""
        if self.discard:
            return
        if not self.announced:
            head = _CALL_HEAD.match(body)
            if head is None:
                return
            self.announced, self.args_start = True, head.end()
            out.append(self._announce(head.group(1)))
        args = body[self.args_start :]
        settled = _CALL_TAIL.search(args).start()
        if settled > self.args_sent:
            out.append(self._arguments(args[self.args_sent : settled]))
            self.args_sent = settled

    def _close_block(self, body: str, end_tag: str, out: list[dict]) -> None:
        self._progress(body, out)
        if not self.announced and not self.discard:
            call = _other_layout(body)
            if call is None:  # not a call: the block is text
                self._outside(TOOL_CALL_START + body + end_tag, out)
            else:
                out.append(self._announce(call[0]))
                out.append(self._arguments(call[1]))
        self.in_block, self.run_has_text, self.blank_run = False, False, ""

    def _announce(self, name: str) -> dict:
        self.calls += 1
        call = {"index": self.calls - 1, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip
        return {"tool_calls": [call]}

    def _arguments(self, piece: str) -> dict:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": piece}}]}


def _other_layout(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block that is a JSON call object in another layout, or None."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    arguments = call["arguments"]
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _content(text: str, out: list[dict]) -> None:
    if out and set(out[-1]) == {"content"}:
        out[-1] = {"content": out[-1]["content"] + text}
    else:
        out.append({"content": text})


# --tool_call_parser's names: LightLLM's (qwen25, qwen) and vLLM's (hermes) for the same format
TOOL_CALL_PARSERS = {"qwen25": QwenToolCallParser, "qwen": QwenToolCallParser, "hermes": QwenToolCallParser}
