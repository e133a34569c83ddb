"""A chat request's tools, as OpenAI shapes them: `tools`, `tool_choice` ("none", "auto", "required" or
{"type": "function", "function": {"name": ...}}), `parallel_tool_calls`, and the assistant turns' `tool_calls`.
The tools go to the chat template (apply_chat_template(tools=...)), which writes them into the prompt the way the
model was trained; "required" and a named choice are enforced, not asked for: the output is constrained (xgrammar's
structural tag for the tool-call parser's format) to one or more calls of the allowed tools whose arguments match
their parameters' JSON schema."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from language.sampling_params import StructuredOutput
from mmserve.http.protocol import BadRequest

TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's rule (letters, digits, _ and -), with . and : as vLLM sees
# The format each --tool_call_parser reads, as xgrammar's builtin structural tags name it
_STRUCTURAL_TAG_MODEL = {"qwen25": "qwen_3", "qwen": "qwen_3", "hermes": "qwen_3"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict] | None  # for the template; None: the request has none
    choice: str | dict  # "none", "auto", "required" or the named function's choice
    parallel: bool
    tool_call_parser: str | None

    @property
    def forced(self) -> bool:
        return self.tools is not None and self.choice not in ("none", "auto")

    def constraint(self, reasoning: str) -> StructuredOutput | None:
        """The output constraint that enforces "required" or a named choice (None for "none" and "auto").
        `reasoning`: xgrammar's reasoning mode ("disabled", "auto" or "enabled": the prompt opened a block)."""
        if not self.forced:
            return None
        import xgrammar  # its import takes a while: only requests that force a call pay it, once

        tag = xgrammar.get_model_structural_tag(
            _STRUCTURAL_TAG_MODEL[self.tool_call_parser],
            tools=self.tools,
            tool_choice=self.choice,
            reasoning=reasoning,
            parallel_tool_calls=self.parallel,
            # the models write compact one-line calls; unbounded blanks would let a call run on to max_tokens
            max_whitespace_cnt=1,
        )
        return StructuredOutput("structural_tag", tag.model_dump_json())


def tool_request(body: dict, tool_call_parser: str | None) -> ToolRequest:
    """Validate the request's tool fields (400 naming the field) -> ToolRequest."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools", "must be a list of tools")
        names: dict[str, int] = {}
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]")
            name = tool["function"]["name"]
            if name in names:  # a call names its tool: two definitions would make it ambiguous
                raise BadRequest(f"tools[{i}].function.name", f"{name!r} is already the name of tools[{names[name]}]")
            names[name] = i
        tools = tools or None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls", "must be a boolean")
    request = ToolRequest(tools, _tool_choice(body.get("tool_choice"), tools), parallel is not False, tool_call_parser)
    if request.forced:
        if tool_call_parser is None:
            raise BadRequest("tool_choice", "a required or named tool_choice needs a server started with "
                             "--tool_call_parser (the model's tool-call format)")  # fmt: skip
        _check_schemas(request)
    return request


def _check_tool(tool: object, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadRequest(f"{where}.type", 'must be "function" (a tool is {"type": "function", "function": {...}})')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{where}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{where}.function.name", "must be 1 to 64 letters, digits, '_', '-', '.' or ':'")
    if not isinstance(function.get("description", ""), str):
        raise BadRequest(f"{where}.function.description", "must be a string")
    if not isinstance(function.get("parameters", {}), dict):
        raise BadRequest(f"{where}.function.parameters", "must be a JSON schema (an object)")
    if not isinstance(function.get("strict", False), bool):
        raise BadRequest(f"{where}.function.strict", "must be a boolean")


def _tool_choice(choice: object, tools: list[dict] | None) -> str | dict:
    """null is "auto" with tools and "none" without, as OpenAI's defaults."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    if choice != "required" and not (isinstance(choice, dict) and choice.get("type") == "function"):
        raise BadRequest("tool_choice", 'must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')  # fmt: skip
    if not tools:
        raise BadRequest("tool_choice", f"{json.dumps(choice)} needs tools")
    if choice == "required":
        return choice
    name = choice.get("function").get("name") if isinstance(choice.get("function"), dict) else None
    if name not in [tool["function"]["name"] for tool in tools]:
        raise BadRequest("tool_choice.function.name", f"names no tool in tools: {json.dumps(name)}")
    return {"type": "function", "function": {"name": name}}


def _check_schemas(request: ToolRequest) -> None:
    """Each tool the output may call must have parameters xgrammar can compile: a bad schema is the client's 400."""
    import xgrammar

    for i, tool in enumerate(request.tools):
        if isinstance(request.choice, dict) and tool["function"]["name"] != request.choice["function"]["name"]:
            continue
        parameters = tool["function"].get("parameters") or {"type": "object"}
        try:
            xgrammar.Grammar.from_json_schema(json.dumps(parameters))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for each kind of fault
            raise BadRequest(f"tools[{i}].function.parameters", f"is not a JSON schema we can enforce: {e}") from None


def assistant_tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant turn's tool_calls -> what chat templates read: each call's arguments as an object (OpenAI sends
    them as JSON text; Qwen2.5's template writes `arguments | tojson`, so text would be quoted twice)."""
    if not isinstance(calls, list):
        raise BadRequest(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{at}.function", "must be an object with a name and arguments")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise BadRequest(f"{at}.function.arguments", "must be JSON text") from None
        if not isinstance(call.get("id", ""), str):
            raise BadRequest(f"{at}.id", "must be a string")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return out
