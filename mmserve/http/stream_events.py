"""/generate_stream's server-sent events, shaped as LightLLM v1.2.0 emits them (its api_lightllm.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mmserve.http.protocol import input_usage, json_logprob, prompt_logprobs_json, token_logprobs_json
from mmserve.ipc.messages import TextOutput


@dataclass
class StreamState:
    """What a /generate_stream response carries from one output to the next."""

    image_tokens: int = 0
    text: list[str] = field(default_factory=list)  # the pieces sent so far (the last event has them joined)
    usage: dict | None = None  # input_usage, fixed by the first output


def stream_events(out: TextOutput, state: StreamState) -> list[str]:
    """The server-sent events of one output, as LightLLM v1.2.0's /generate_stream: one event per generated token,
    whose `token.text` is the new text: the output's text rides on its last token, the others have "" (as a token
    that completes no character has in LightLLM); an output without tokens (an abort's end) is one event with a
    null token id. The last event has finished, finish_reason and (ours, as TGI's) the whole generated_text;
    LightLLM sends null there. The first event carries prompt_token_ids and prompt_logprobs when asked."""
    if not out.tokens and not out.text and not out.finished:
        return []
    if state.usage is None:
        state.usage = input_usage(out.prompt_tokens, state.image_tokens)
    state.text.append(out.text)
    tokens = out.tokens or [None]
    first_count = out.output_tokens - len(out.tokens)
    events = []
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        finished = out.finished and last
        event = {
            "token": {
                "id": t.id if t else None,
                "text": out.text if last else "",
                "logprob": json_logprob(t.logprob) if t else None,
                "special": t.special if t else False,
                "count_output_tokens": first_count + i + 1 if t else out.output_tokens,
                "prompt_tokens": out.prompt_tokens,
                "logprobs": token_logprobs_json(t) if t else {},
            },
            "generated_text": "".join(state.text) if finished else None,
            "finished": finished,
            "finish_reason": out.finish_reason if finished else None,
            "details": None,
            "input_usage": state.usage,
            "prompt_cache_len": out.cached_tokens,  # ours: prompt tokens whose KV came from the prefix cache
        }
        if i == 0 and out.prompt_logprobs is not None:
            event.update(prompt_logprobs_json(out.prompt_logprobs))
        events.append(f"data:{json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n")
    return events
