"""The OpenAI API's request side, as vLLM shapes it: chat messages and completion bodies -> the server's own
`GenerateInput` (prompt text, `SamplingParams`, `multimodal_params`), so that every request runs the one pipeline
that /generate runs. Chat prompts are rendered by transformers' `apply_chat_template` from the checkpoint's own
template (with the request's tools: chat_tools.py); image parts become `multimodal_params.images` entries in prompt
order."""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from language.sampling_params import MAX_TOP_LOGPROBS, InvalidParams, SamplingParams
from mmserve.http.chat_tools import TOOL_FIELDS, ToolRequest, assistant_tool_calls, tool_request
from mmserve.http.openai_extras import EXTRA_NAMES, check_batch_size, completion_prompts, extra_kwargs
from mmserve.http.protocol import BadRequest, GenerateInput
from mmserve.http.reasoning_parsers import prompt_opens_thinking
from mmserve.http.structured import OPENAI_NAMES as STRUCTURED_NAMES
from mmserve.http.structured import openai_constraint, openai_field, with_constraint
from mmserve.prep.multimodal.image_io import BadImage, ImagePolicy
from mmserve.prep.multimodal.qwen_vl import read_allowed_path

SAMPLING_NAMES = frozenset(
    {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
     "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
     "ignore_eos", "user", "model", *STRUCTURED_NAMES}
) | EXTRA_NAMES  # fmt: skip
CHAT_NAMES = (
    SAMPLING_NAMES | {"messages", "chat_template_kwargs", "add_generation_prompt", "mm_processor_kwargs"} | TOOL_FIELDS
)
COMPLETION_NAMES = SAMPLING_NAMES | {"prompt", "echo"}


def check_names(body: dict, allowed: frozenset) -> None:
    for name in body:
        if name not in allowed:
            raise BadRequest(name, "unknown or unsupported field")


def sampling_params(body: dict, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """OpenAI's sampling fields -> SamplingParams (validated); n > 1 fans out as /generate's n does. `defaults`: the
    values of fields the body leaves unset (the model's generation config: generation_defaults.py)."""
    body = {**(defaults or {}), **{k: v for k, v in body.items() if v is not None}}
    n = body.get("n")
    max_tokens = body.get(max_tokens_field(body))
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop", "must be a non-empty string or a list of non-empty strings")
    kwargs = {
        "do_sample": isinstance(temperature, (int, float)) and temperature > 0,
        "temperature": temperature,
        "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "stop_sequences": tuple(stop),
        "return_details": True,
        "n": 1 if n is None else n,
    }
    for name in (
        "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos"
    ):  # fmt: skip
        if body.get(name) is not None:
            kwargs[name] = body[name]
    kwargs.update(extra_kwargs(body))
    try:  # the output constraint last: its compile check is the costly one
        params = with_constraint(SamplingParams(**kwargs).validate(), openai_constraint(body))
    except InvalidParams as e:  # named as the pipeline names it: openai_param maps it to the client's field
        raise BadRequest(e.field, e.message) from None
    if body.get("stream") and params.num_sequences > params.n:
        raise BadRequest("best_of", "must equal n with stream: true (the best sequences are known only at the end)")
    return params


def max_tokens_field(body: dict) -> str:
    """The field that sets the completion's length: max_completion_tokens (OpenAI's newer name) wins over
    max_tokens when both are given."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


# The shared pipeline's names (/generate's `parameters` and SamplingParams' fields) that an OpenAI request sets under
# another name. Every error on the OpenAI routes goes through openai_param, so the client hears the name it sent.
_OPENAI_NAMES = {
    "stop_sequences": "stop",
    "prompt_logprobs": "logprobs",
    "do_sample": "temperature",
    "min_new_tokens": "min_tokens",
    "add_spaces_between_special_tokens": "spaces_between_special_tokens",
}
_PIPELINE_NAME = re.compile(r"\b(" + "|".join(["max_new_tokens", *_OPENAI_NAMES]) + r")\b")


def openai_param(e: BadRequest, body: dict | None, prompt_field: str) -> tuple[str, str]:
    """A pipeline error (named as /generate names it) -> (param, message) named by the OpenAI request's fields: the
    prompt (`inputs`) and its images are `prompt_field` (messages or prompt), max_new_tokens is the max_tokens or
    max_completion_tokens the client sent, and the message says so too."""
    names = {**_OPENAI_NAMES, "max_new_tokens": max_tokens_field(body or {})}
    # the engine's compile error: of the constraint the client sent, else of its tools' (tool_choice)
    names["structured"] = openai_field(body or {}) or ("tools" if (body or {}).get("tools") else "response_format")
    for sent in ("prompt_logprobs", "do_sample"):  # vLLM's and LightLLM's own fields, when the client sent them
        if (body or {}).get(sent) is not None:
            names[sent] = sent
    field = e.field.removeprefix("parameters.")
    if e.field == "inputs" or e.field.startswith("multimodal_params"):
        param = prompt_field
    else:
        param = names.get(field, field)
    message = _PIPELINE_NAME.sub(lambda m: names[m.group(1)], e.message)
    if e.field.startswith("multimodal_params"):  # which image or video: image[i] / video[i], in prompt order
        where = e.field.replace("multimodal_params.images", "image").replace("multimodal_params.videos", "video")
        return param, f"{where}: {message}"
    return param, f"{param}: {message}"


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs


def logprobs_request(body: dict, chat: bool) -> int | None:
    """How many alternatives each generated token's logprobs carry, or None for no logprobs. Chat: `logprobs: true`
    with `top_logprobs` k in [0, 20] (default 0); completions: `logprobs: k` in [0, 5]."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadRequest("logprobs", "must be a boolean")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise BadRequest("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
            if not logprobs:
                raise BadRequest("top_logprobs", "requires logprobs: true")
        return (top or 0) if logprobs else None
    if top is not None:
        raise BadRequest("top_logprobs", "is a chat field: /v1/completions takes logprobs (an integer)")
    if logprobs is None:
        return None
    if not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise BadRequest("logprobs", f"must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    return logprobs


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("stream_options", "must be an object")
    if not body.get("stream"):
        raise BadRequest("stream_options", "is only allowed with stream: true")
    return bool(options.get("include_usage"))


def continuous_usage(body: dict) -> bool:
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries its choice's usage so
    far too."""
    return include_usage(body) and bool(body["stream_options"].get("continuous_usage_stats"))


# ------------------------------------------------------------------------------------------------- chat


def image_item(url: object, param: str, image_dir: str | None) -> dict:
    """An `image_url.url` -> a `multimodal_params.images` entry, under the same rules as /generate's images:
    data: URLs carry base64, http(s) URLs are fetched under the server's fetch rules, and a local path is read only
    from inside --image_dir."""
    if not isinstance(url, str) or not url:
        raise BadRequest(param, "must be a non-empty string")
    if url.startswith("data:"):
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise BadRequest(param, "a data: URL must be data:<mime>;base64,<data>")
        return {"type": "base64", "data": data}
    if url.startswith(("http://", "https://")):
        return {"type": "url", "data": url}
    path = url.removeprefix("file://")
    try:
        data = read_allowed_path(path, image_dir, ImagePolicy().max_bytes)  # the limit of sent images
    except BadImage as e:
        raise BadRequest(param, str(e)) from None
    return {"type": "base64", "data": base64.b64encode(data).decode()}


def chat_messages(
    raw: object, image_dir: str | None, multimodal: bool = True
) -> tuple[list[dict], list[dict], list[dict]]:
    """OpenAI messages -> (messages for apply_chat_template, image entries, video entries, each in prompt order).
    Image parts become {"type": "image"} parts, and `video_url` parts (vLLM's) {"type": "video"} parts, which the
    published VLM templates turn into their family's placeholders. A server
    without --enable_multimodal refuses an image part before anything is read or rendered, as /generate does.
    Any role goes to the template (system, user, assistant, tool, developer, a custom one), as vLLM's: the template
    refuses what it does not know; a tool turn keeps its tool_call_id and name, an assistant turn its tool_calls."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages", "must be a non-empty list")
    messages, images, videos = [], [], []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(where, "must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"{where}.role", "must be a non-empty string")
        turn = _turn_fields(message, where)
        if content is None:
            content = ""
        if isinstance(content, str):
            messages.append({"role": role, "content": content, **turn})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content", "must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"{at}.text", "must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                image_url = part.get("image_url")
                if not isinstance(image_url, dict):  # as vLLM and OpenAI: {"url": ...}, never a bare string
                    raise BadRequest(f"{at}.image_url", 'must be an object {"url": ...}')
                if not multimodal:
                    raise BadRequest(f"{at}.image_url", "this server was started without --enable_multimodal")
                images.append(image_item(image_url.get("url"), f"{at}.image_url.url", image_dir))
                parts.append({"type": "image"})
            elif kind == "video_url":
                video_url = part.get("video_url")
                if not isinstance(video_url, dict):
                    raise BadRequest(f"{at}.video_url", 'must be an object {"url": ...}')
                if not multimodal:
                    raise BadRequest(f"{at}.video_url", "this server was started without --enable_multimodal")
                videos.append(image_item(video_url.get("url"), f"{at}.video_url.url", image_dir))
                parts.append({"type": "video"})
            else:
                raise BadRequest(f"{at}.type", "must be 'text', 'image_url' or 'video_url'")
        messages.append({"role": role, "content": parts, **turn})
    return messages, images, videos


def _turn_fields(message: dict, where: str) -> dict:
    """A message's fields besides role and content that chat templates read: tool_calls (an assistant's), and
    tool_call_id and name (a tool result's)."""
    fields = {}
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise BadRequest(f"{where}.{name}", "must be a string")
            fields[name] = message[name]
    if message.get("tool_calls") is not None:
        fields["tool_calls"] = assistant_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return fields


@dataclass(frozen=True)
class OpenAIOptions:
    """The server flags the OpenAI routes read."""

    image_dir: str | None = None  # the only folder local image paths may be read from
    served_model_name: str | None = None  # the model id; None: the model folder's name
    chat_template: str | None = None  # a Jinja template file that overrides the checkpoint's
    model_dir: str | None = None  # the served checkpoint (its folder names the model; its config, the family)
    tool_call_parser: str | None = None  # the model's tool-call format (tool_parsers.py); None: calls are not read
    reasoning_parser: str | None = None  # the model's reasoning format (reasoning_parsers.py)
    # unset request fields' values, by the request's names: the model's generation config (generation_defaults.py)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)

    def checkpoint_dir(self, tokenizer) -> str:
        """--model_dir, else where the tokenizer was loaded from (not every tokenizer knows: Qwen-VL's tiktoken one)."""
        return self.model_dir or getattr(tokenizer, "name_or_path", None) or ""

    def model_name(self, tokenizer) -> str:
        """The model id (/v1/models, /get_model_name): --served_model_name, else the checkpoint folder's name."""
        folder = self.checkpoint_dir(tokenizer)
        return self.served_model_name or (os.path.basename(os.path.normpath(folder)) if folder else "mmserve")


def find_chat_template(tokenizer, model_dir: str | None) -> str | None:
    """The checkpoint's own template: tokenizer_config.json's (as the tokenizer loaded it), else chat_template.jinja
    or chat_template.json (the processor's)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return template
    if model_dir and os.path.isdir(model_dir):
        jinja = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                return f.read()
        path = os.path.join(model_dir, "chat_template.json")
        if os.path.isfile(path):
            with open(path) as f:
                template = json.load(f).get("chat_template")
            if isinstance(template, str) and template:
                return template
    return None


# A template that loops over a message's content parts (llava-hf's, Qwen2-VL's) expects them as a list; some (llava-hf)
# render a plain string content as nothing. vLLM detects this ("openai" content format) and passes such a message's
# string as one text part; so does render_chat.
_LOOPS_OVER_PARTS = re.compile(r"for\s+\w+\s+in\s+message\[['\"]content['\"]\]")


def render_chat(tokenizer, template: str | None, messages: list[dict], body: dict, tools: list | None = None) -> str:
    if template is not None and _LOOPS_OVER_PARTS.search(template):
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
                    for m in messages]  # fmt: skip
    if template is None:
        raise BadRequest("messages", "this model has no chat template (none in tokenizer_config.json, "
                         "chat_template.jinja or chat_template.json); use /v1/completions with a prompt")  # fmt: skip
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs", "must be an object")
    reserved = sorted(
        set(kwargs) & {"chat_template", "tokenize", "add_generation_prompt", "conversation", "messages", "tools"}
    )
    if reserved:
        raise BadRequest("chat_template_kwargs", f"may not set {reserved}")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **kwargs,
        )
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise BadRequest("messages", f"the chat template could not render these messages: {e}") from None


def chat_input(
    body: dict,
    tokenizer,
    template: str | None,
    image_dir: str | None,
    default_max: int,
    multimodal: bool = True,
    options: OpenAIOptions | None = None,
) -> GenerateInput:
    """A chat body -> the server's GenerateInput (runs in the tokenizer pool: rendering, file reads and schema
    checks are slow)."""
    options = options or OpenAIOptions()
    check_names(body, CHAT_NAMES)
    params = sampling_params(body, default_max, options.sampling_defaults)
    params = replace(params, top_logprobs=logprobs_request(body, chat=True) or 0)
    tools = tool_request(body, options.tool_call_parser)
    messages, images, videos = chat_messages(body.get("messages"), image_dir, multimodal)
    prompt = render_chat(tokenizer, template, messages, body, tools.tools)
    bos = getattr(tokenizer, "bos_token", None)
    if params.add_special_tokens is None and bos and prompt.startswith(bos):
        # the template wrote the BOS itself (Gemma 3's): the tokenizer must not add a second one
        params = replace(params, add_special_tokens=False)
    params = _with_tool_constraint(params, tools, prompt, options.reasoning_parser)
    unset = all(body.get(name) is None for name in ("max_tokens", "max_completion_tokens"))
    unset = unset and "max_tokens" not in options.sampling_defaults
    mm = {"images": images} if images else {}
    if videos:
        mm = {**mm, "videos": videos, "mm_processor_kwargs": body.get("mm_processor_kwargs")}
    return GenerateInput(prompt, params, mm, fill_context=unset)


def _with_tool_constraint(
    params: SamplingParams, tools: ToolRequest, prompt: str, reasoning_parser: str | None
) -> SamplingParams:
    """A required or named tool_choice constrains the output to calls (after a reasoning block, for a server that
    reads one: the one the prompt opened, else an optional one)."""
    reasoning = "disabled"
    if reasoning_parser is not None:
        reasoning = "enabled" if prompt_opens_thinking(prompt) else "auto"
    constraint = tools.constraint(reasoning)
    if constraint is None:
        return params
    if params.structured is not None:
        raise BadRequest("tool_choice", "a required or named tool_choice cannot be combined with response_format")
    try:
        return replace(params, structured=constraint).validate()
    except InvalidParams as e:  # the tools' schemas are the constraint's size
        raise BadRequest("tools", e.message) from None


def completion_inputs(
    body: dict, default_max: int, tokenizer, sampling_defaults: Mapping[str, Any] | None = None
) -> list[GenerateInput]:
    """A completion body -> one GenerateInput per prompt (a token-id prompt carries its ids, and their text for
    echo); max_tokens defaults to 16, as OpenAI's and vLLM's /v1/completions. `echo` with logprobs scores the
    prompt too (prompt_logprobs with at least as many alternatives). Runs in the tokenizer pool."""
    check_names(body, COMPLETION_NAMES)
    if not isinstance(body.get("echo", False), bool):
        raise BadRequest("echo", "must be a boolean")
    prompts = completion_prompts(body, len(tokenizer))
    params = sampling_params(body, min(16, default_max), sampling_defaults)
    check_batch_size(len(prompts), params.num_sequences)
    k = logprobs_request(body, chat=False)
    scored = params.prompt_logprobs
    if body.get("echo") and k is not None:
        scored = max(k, scored or 0)
    params = replace(params, top_logprobs=k or 0, prompt_logprobs=scored)
    return [_completion_input(p, params, tokenizer) for p in prompts]


def _completion_input(prompt: str | tuple[int, ...], params: SamplingParams, tokenizer) -> GenerateInput:
    if isinstance(prompt, str):
        return GenerateInput(prompt, params)
    return GenerateInput(tokenizer.decode(list(prompt), skip_special_tokens=False), params, prompt_ids=prompt)
