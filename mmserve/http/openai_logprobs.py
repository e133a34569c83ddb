"""OpenAI's logprobs answers, as vLLM shapes them: a choice's tokens (and, with /v1/completions' echo, its prompt's)
as chat's `content` list or the completions' legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.http.protocol import json_logprob
from mmserve.ipc.messages import TokenDetail

# One position of a logprobs answer: (token text, its log-probability or None (a prompt's first token), the
# alternatives there as (text, log-probability), or None).
Entry = tuple[str, float | None, list[tuple[str, float]] | None]


@dataclass(frozen=True)
class Echo:
    """/v1/completions' echo: the prompt text put before the completion, and its positions' logprobs (when asked)."""

    text: str
    entries: list[Entry]


def token_entries(tokens: list[TokenDetail]) -> list[Entry]:
    """A choice's tokens -> logprobs entries. A token's text is the text it completed (TokenDetail.text: "" for the
    first bytes of a multi-byte character), so the tokens join to the generated text before any stop cut; each
    alternative is its token decoded alone."""
    return [(t.text, t.logprob, [(text, lp) for _, text, lp in t.top]) for t in tokens]


def choice_logprobs(entries: list[Entry], chat: bool, k: int, offset: int = 0) -> dict:
    """OpenAI's logprobs of a choice (or of a chunk's tokens). Chat: each token with its k alternatives; completions
    (legacy shape): tokens, token_logprobs, text_offset, and top_logprobs as one {text: logprob} per position (the
    chosen token and its k alternatives: with k 0, the chosen token alone, as vLLM answers logprobs 0)."""
    floor = json_logprob
    if chat:
        content = [{"token": text, "logprob": floor(lp), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": a, "logprob": floor(alp), "bytes": list(a.encode())}
                                     for a, alp in top or ()]}
                   for text, lp, top in entries]  # fmt: skip
        return {"content": content}
    text_offset, tops = [], []
    for text, lp, top in entries:
        text_offset.append(offset)
        offset += len(text)
        if lp is None:
            tops.append(None)
        else:
            ranked = {text: floor(lp)}
            for a, alp in top or ():
                ranked.setdefault(a, floor(alp))
            tops.append(ranked)
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [floor(lp) for _, lp, _ in entries],
            "top_logprobs": tops, "text_offset": text_offset}  # fmt: skip
