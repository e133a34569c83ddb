"""The OpenAI-compatible API, as vLLM shapes it: GET /v1/models, POST /v1/chat/completions and POST /v1/completions
(streaming or not). Each request becomes the server's own GenerateInput (`openai_protocol.py`) and goes through the
same engine client as /generate: tokenization, image checks and fetch rules, the embedding cache, the detokenizer
and its stop handling. Errors come in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from language.request import PromptLogprobs, RequestError
from mmserve.http.chat_output import ChatOutputPlan, chat_message, output_plan
from mmserve.http.chat_output import finish_reason as choice_finish_reason
from mmserve.http.engine_client import ClientDisconnected, EngineClient, RequestStream, ServerFailure
from mmserve.http.openai_logprobs import Echo, Entry, choice_logprobs, token_entries
from mmserve.http.openai_protocol import (
    OpenAIOptions,
    chat_input,
    completion_inputs,
    continuous_usage,
    find_chat_template,
    include_usage,
    logprobs_request,
    openai_param,
    render_chat,
)
from mmserve.http.openapi import openai_route
from mmserve.http.protocol import BadRequest, GenerateInput, json_logprob, parse_json
from mmserve.http.request_io import (
    check_json_content_type,
    collect_streams,
    log_request_timing,
    merge_streams,
    most_likely,
    read_request_body,
    watch_disconnect,
)
from mmserve.http.slow_clients import ClosingStreamingResponse
from mmserve.ipc.messages import TextOutput, TokenDetail
from mmserve.prep.chat_templates import builtin_chat_template, model_architecture

_CLIENT_CLOSED = 499


def openai_error(message: str, status: int = 400, param: str | None = None, kind: str | None = None) -> JSONResponse:
    if kind is None:
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _bad_request(e: BadRequest, body: dict | None, prompt_field: str) -> JSONResponse:
    param, message = openai_param(e, body, prompt_field)
    return openai_error(message, e.status, param)


def _request_error(e: RequestError, body: dict, chat: bool) -> JSONResponse:
    """A request the router or the engine refused (named by the client's own fields) or failed (naming none)."""
    if e.param is None:
        return openai_error(e.message, e.status)
    return _bad_request(BadRequest.of(e), body, "messages" if chat else "prompt")


class OpenAIServing:
    def __init__(self, client: EngineClient, options: OpenAIOptions):
        self.client = client
        self.tokenizer = client.preparer.tokenizer
        self.model_dir = options.checkpoint_dir(self.tokenizer)
        self.model_name = options.model_name(self.tokenizer)
        if options.chat_template is not None:  # --chat_template overrides the checkpoint's own
            with open(options.chat_template) as f:
                self.template = f.read()
        else:
            # the checkpoint's own, else the family's built-in (chat_templates.py)
            self.template = find_chat_template(self.tokenizer, self.model_dir) or builtin_chat_template(
                model_architecture(self.model_dir)
            )
        self.created = int(time.time())
        self.options = options
        self.image_dir = options.image_dir
        self.multimodal = client.preparer.images is not None  # --enable_multimodal

    def warm_chat_template(self) -> None:
        """Render the chat template once, so that transformers has compiled it before the first chat request."""
        try:
            render_chat(self.tokenizer, self.template, [{"role": "user", "content": "Hello"}], {})
        except BadRequest:  # no template, or one that refuses this conversation: the first request will say so
            pass

    @property
    def max_len(self) -> int:
        return self.client.preparer.limits.max_req_total_len

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mmserve",
                "root": self.model_dir, "parent": None, "max_model_len": self.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def submit(self, request: Request, parse: Callable[[dict, int], list[GenerateInput]], prompt_field: str):
        """-> (body, its inputs (one per prompt), one list of RequestStreams per input) or an error response. A
        chat with no max_tokens may fill the context, as vLLM's (`fill_context`: the preparer sizes it once the
        prompt is tokenized). n / best_of > 1 fans out as /generate's does (one tokenization and image encoding
        shared, sequence i seeded with seed + i); a refused prompt of a list aborts the ones already submitted."""
        body, groups = None, []
        try:
            check_json_content_type(request)
            start = time.perf_counter()
            raw = await read_request_body(request)
            read = time.perf_counter()
            body = await self.client.run_sync(parse_json, raw)  # big bodies: off the loop
            include_usage(body)  # checked before anything is submitted
            model = body.get("model")
            if model is not None and model != self.model_name:
                return openai_error(f"The model `{model}` does not exist.", 404, "model")
            inputs = await self.client.run_sync(parse, body, self.max_len)
            parsed = time.perf_counter()
            for req in inputs:
                groups.append(await self.client.submit_group(req, req.params.num_sequences))
            if groups and groups[0]:
                log_request_timing(groups[0][0].rid, len(raw), start, read, parsed)
            return body, inputs, groups
        except BadRequest as e:
            self._abort_unfinished([s for streams in groups for s in streams])
            return _bad_request(e, body, prompt_field)
        except ServerFailure as e:
            self._abort_unfinished([s for streams in groups for s in streams])
            return openai_error(f"server failure: {e}", 503)

    def _parse_chat(self, body: dict, default_max: int) -> list[GenerateInput]:
        return [
            chat_input(body, self.tokenizer, self.template, self.image_dir, default_max, self.multimodal, self.options)
        ]

    def _parse_completion(self, body: dict, default_max: int) -> list[GenerateInput]:
        return completion_inputs(body, default_max, self.tokenizer, self.options.sampling_defaults)

    async def respond(self, request: Request, kind: str) -> Response:
        chat = kind == "chat"
        parse = self._parse_chat if chat else self._parse_completion
        result = await self.submit(request, parse, "messages" if chat else "prompt")
        if isinstance(result, Response):
            return result
        body, inputs, groups = result
        streams = [stream for group in groups for stream in group]
        rid = ("chatcmpl-" if chat else "cmpl-") + streams[0].rid.split("-")[0]
        # how each chat choice's text is read: reasoning and tool calls (chat_output.py)
        plan = output_plan(body, inputs[0].prompt, self.options.tool_call_parser, self.options.reasoning_parser)
        disconnected = watch_disconnect(request)
        if body.get("stream"):
            return await self._start_stream(body, inputs, streams, rid, plan if chat else None, disconnected)
        try:
            results = await collect_streams(self.client, streams, disconnected)
        except ServerFailure as e:
            return openai_error(f"server failure: {e}", 503)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        for out, _, _ in results:
            if out.error is not None:
                return _request_error(out.error, body, chat)
        k = logprobs_request(body, chat)  # alternatives per position; None: no logprobs
        n, choices, kept, start = inputs[0].params.n, [], [], 0
        answer: dict = {}
        for p, (req, group) in enumerate(zip(inputs, groups, strict=True)):
            mine, start = results[start : start + len(group)], start + len(group)
            scores = mine[0][0].prompt_logprobs  # sequence 0 scores the prompt
            # vLLM's prompt_logprobs: on each choice (completions), on the answer (chat)
            scored = await self._prompt_logprobs(scores) if body.get("prompt_logprobs") is not None else None
            if chat and scored is not None:
                answer["prompt_logprobs"] = scored
            echo = await self._echo(req.prompt, scores if k is not None else None, k) if body.get("echo") else None
            kept.append(most_likely(mine, n))  # best_of: the n most likely
            for j, (out, text, tokens) in enumerate(kept[-1]):
                choices.append(self._choice(p * n + j, out, text, tokens, echo, plan if chat else None, k))
                if not chat and scored is not None:
                    choices[-1]["prompt_logprobs"] = scored
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, **answer,
            "usage": _usage([[out for out, _, _ in group] for group in kept]),
        })  # fmt: skip

    @staticmethod
    def _choice(
        index: int, out: TextOutput, text: str, tokens: list[TokenDetail], echo, plan: ChatOutputPlan | None, k
    ) -> dict:
        """plan: a chat's (None: a completion's)."""
        chat = plan is not None
        lp = None
        if k is not None:
            lp = choice_logprobs((echo.entries if echo else []) + token_entries(tokens), chat, k)
        if echo is not None:
            text = echo.text + text
        if chat:
            message, called = chat_message(text, plan)
            return {"index": index, "message": message, "logprobs": lp,
                    "finish_reason": choice_finish_reason(out.finish_reason, called),
                    "stop_reason": out.stop_reason}  # fmt: skip
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}  # fmt: skip

    async def _echo(self, prompt: str, scores: PromptLogprobs | None, k: int | None) -> Echo:
        """The prompt to echo; with its scores (echo with logprobs), each prompt token and its k alternatives
        decoded alone (in the tokenizer pool), the first token without a logprob."""
        if scores is None:
            return Echo(prompt, [])
        top = [alts[:k] for alts in scores.top] if scores.top else [[] for _ in scores.logprobs]
        ids = [[i] for i in scores.token_ids] + [[i] for alts in top for i, _ in alts]
        texts = iter(await self.client.run_sync(self._decode_each, ids))
        words = [next(texts) for _ in scores.token_ids]
        entries: list[Entry] = [(words[0], None, None)]
        for i, (lp, alts) in enumerate(zip(scores.logprobs, top, strict=True)):
            entries.append((words[i + 1], lp, [(next(texts), alp) for _, alp in alts]))
        return Echo(prompt, entries)

    async def _prompt_logprobs(self, scores: PromptLogprobs) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per position {token id: {logprob, rank,
        decoded_token}} for the prompt's own token and the alternatives asked (rank: 1 for the most likely; null
        for a prompt token outside them, whose rank the engine does not compute)."""
        top = scores.top or [[] for _ in scores.logprobs]
        ids = [[i] for i in scores.token_ids[1:]] + [[i] for alts in top for i, _ in alts]
        texts = iter(await self.client.run_sync(self._decode_each, ids))
        own = [next(texts) for _ in scores.logprobs]
        positions: list[dict | None] = [None]
        for token, lp, text, alts in zip(scores.token_ids[1:], scores.logprobs, own, top, strict=True):
            ranked = {str(t): {"logprob": json_logprob(alp), "rank": r + 1, "decoded_token": next(texts)}
                      for r, (t, alp) in enumerate(alts)}  # fmt: skip
            rank = ranked[str(token)]["rank"] if str(token) in ranked else None
            positions.append({str(token): {"logprob": json_logprob(lp), "rank": rank, "decoded_token": text},
                              **{t: v for t, v in ranked.items() if t != str(token)}})  # fmt: skip
        return positions

    def _decode_each(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.client.abort(stream.rid)

    async def _start_stream(self, body, inputs, streams, rid, plan: ChatOutputPlan | None, disconnected) -> Response:
        """plan: a chat's (None: a completion's)."""
        chat = plan is not None
        tasks = [asyncio.ensure_future(stream.next(disconnected)) for stream in streams]
        try:  # a rejection before any token still gets its status code
            firsts = await asyncio.gather(*tasks)
        except (ServerFailure, ClientDisconnected) as e:
            for task in tasks:
                task.cancel()
            disconnected.cancel()
            self._abort_unfinished(streams)
            if isinstance(e, ServerFailure):
                return openai_error(f"server failure: {e}", 503)
            return Response(status_code=_CLIENT_CLOSED)
        for first in firsts:
            if first.error is not None:
                disconnected.cancel()
                self._abort_unfinished(streams)
                return _request_error(first.error, body, chat)
        events = self._events(body, inputs, streams, firsts, rid, plan, disconnected)
        return ClosingStreamingResponse(events, media_type="text/event-stream")

    async def _events(self, body, inputs, streams, firsts, rid, plan, disconnected) -> AsyncIterator[str]:
        """Choice i (streams[i]: best_of is n when streaming) answers prompt i // n."""
        chat = plan is not None
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        # each chat choice's parsers (reasoning, tool calls): a piece of text may become several deltas
        parsers = [plan.stream() for _ in streams] if chat and plan.parses else None
        usage, k = include_usage(body), logprobs_request(body, chat)
        logprobs, n = k is not None, inputs[0].params.n
        echoes = None
        if body.get("echo"):
            echoes = [await self._echo(req.prompt, firsts[p * n].prompt_logprobs if logprobs else None, k)
                      for p, req in enumerate(inputs)]  # fmt: skip
        offsets = [0] * len(streams)  # completions' text_offset, per choice
        # continuous_usage_stats: each chunk carries its choice's usage so far (its prompt, its tokens out)
        counted = [0] * len(streams) if continuous_usage(body) else None

        def chunk(choices: list, **extra) -> str:
            event = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if counted is not None and choices:
                index = choices[0]["index"]
                prompt_tokens = firsts[index].prompt_tokens
                event["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": counted[index],
                                  "total_tokens": prompt_tokens + counted[index]}  # fmt: skip
            return f"data: {json.dumps({**event, **extra}, ensure_ascii=False)}\n\n"

        def choice(index: int, out: TextOutput | Echo | None, finish_reason: str | None = None, role: bool = False,
                   delta: dict | None = None, stop_reason: str | int | None = None) -> dict:  # fmt: skip
            text = out.text if out is not None else ""
            lp = None
            if logprobs and out is not None:
                entries = out.entries if isinstance(out, Echo) else token_entries(out.tokens)
                lp = choice_logprobs(entries, chat, k, offsets[index])
                offsets[index] += sum(len(text) for text, _, _ in entries)
            end = {"finish_reason": finish_reason, "stop_reason": stop_reason}
            if not chat:
                return {"index": index, "text": text, "logprobs": lp, **end}
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else {"content": text}
            return {"index": index, "delta": delta, "logprobs": lp, **end}

        def parsed(index: int, out: TextOutput) -> Iterator[str]:
            """A chat choice's output through its parsers: one chunk per delta, the tokens' logprobs on the first."""
            parser = parsers[index]
            deltas = parser.feed(out.text) if out.text else []
            if out.finished:
                deltas += parser.finish()
            if not deltas and logprobs and out.tokens:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield chunk([choice(index, out if i == 0 else None, delta=delta)])
            if out.finished:
                reason = choice_finish_reason(out.finish_reason, parser.called)
                yield chunk([choice(index, None, reason, stop_reason=out.stop_reason)])

        finals: list[TextOutput | None] = [None] * len(streams)
        merged = merge_streams(streams, firsts, disconnected)
        try:
            for index in range(len(streams)):
                if chat:
                    yield chunk([choice(index, None, role=True)])
                elif echoes is not None:  # the prompt first, as vLLM streams echo
                    yield chunk([choice(index, echoes[index // n])])
            async for index, out in merged:
                if out.error is not None:  # ended by the engine after its first tokens: why, as an error event
                    yield f"data: {_request_error(out.error, body, chat).body.decode()}\n\n"
                if counted is not None:
                    counted[index] = out.output_tokens
                if parsers is not None:
                    for event in parsed(index, out):
                        yield event
                    if out.finished:
                        finals[index] = out
                    continue
                if out.text or (logprobs and out.tokens):
                    yield chunk([choice(index, out)])
                if out.finished:
                    finals[index] = out
                    yield chunk([choice(index, None, out.finish_reason, stop_reason=out.stop_reason)])
            if usage:
                yield chunk([], usage=_usage([finals[p * n : (p + 1) * n] for p in range(len(inputs))]))
            yield "data: [DONE]\n\n"
        except ServerFailure as e:
            error = {"message": f"server failure: {e}", "type": "server_error", "param": None, "code": 503}
            yield f"data: {json.dumps({'error': error})}\n\n"
        except ClientDisconnected:
            return
        finally:
            await merged.aclose()
            disconnected.cancel()
            self._abort_unfinished(streams)


def _usage(groups: list[list[TextOutput]]) -> dict:
    """Per prompt (a group: its choices' last outputs), the prompt counted once and the completion tokens of every
    choice (as OpenAI's n); summed over the prompts (as vLLM's list prompts)."""
    prompt = sum(finals[0].prompt_tokens for finals in groups)
    completion = sum(out.output_tokens for finals in groups for out in finals)
    cached = sum(finals[0].cached_tokens for finals in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def add_openai_routes(app: FastAPI, client: EngineClient, options: OpenAIOptions) -> OpenAIServing:
    """The /v1 routes; returns their OpenAIServing (for the tokenizer routes), built here, not on the event loop: it
    reads the chat template's file."""
    serving = OpenAIServing(client, options)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @app.post("/v1/chat/completions", **openai_route("chat"))
    async def chat_completions(request: Request) -> Response:
        return await serving.respond(request, "chat")

    @app.post("/v1/completions", **openai_route("completion"))
    async def completions(request: Request) -> Response:
        return await serving.respond(request, "completion")

    return serving
