"""What the engine's tensors and the cache can hold of a request, checked before it is queued. The server's HTTP
side checks the length (the same rule) and the parameters before anything reaches the engine; direct callers (the
offline LLM) may not have."""

from __future__ import annotations

from typing import NoReturn

from language.model_info import ModelInfo
from language.request import Request, RequestError, RequestRejected, length_error
from language.sampling_params import InvalidParams


def check_request(req: Request, info: ModelInfo, no_structured: str | None) -> None:
    """Raise RequestRejected saying why `req` can never run. no_structured: why structured output is refused on
    this engine, or None where it is served."""
    if req.prompt_len == 0:
        refuse("inputs", "the prompt is empty")
    too_long = length_error(req.prompt_len, req.params.max_new_tokens, info.request_limit)
    if too_long is not None:
        raise RequestRejected(too_long)
    if any(t < 0 or t >= info.vocab_size for t in req.prompt_ids):
        refuse("inputs", "prompt token id out of the vocabulary")
    for item in req.mm_items:
        if item.embeds is None:
            continue  # covered by the cached prefix, or refused by the engine
        if item.embeds.dim() != 2 or item.embeds.shape[1] != info.mm_embed_width:
            refuse("inputs", f"image embeddings of shape {tuple(item.embeds.shape)}: this model takes rows of "
                   f"{info.mm_embed_width} values")  # fmt: skip
    _check_params(req, info, no_structured)


def _check_params(req: Request, info: ModelInfo, no_structured: str | None) -> None:
    p = req.params
    try:
        p.validate()
    except InvalidParams as e:
        refuse(f"parameters.{e.field}", e.message)
    if p.structured is not None and no_structured is not None:
        refuse("parameters.structured", no_structured)
    vocab = info.vocab_size
    for name, ids in (
        ("allowed_token_ids", p.allowed_token_ids or ()),
        ("logit_bias", [t for t, _ in p.logit_bias]),
    ):
        outside = sorted({t for t in ids if t < 0 or t >= vocab})
        if outside:
            refuse(f"parameters.{name}", f"token ids {outside[:8]} are out of the vocabulary (size {vocab})")
    if p.min_new_tokens and p.allowed_token_ids is not None:
        if set(p.allowed_token_ids) <= p.min_tokens_bans(info.eos_token_ids):
            refuse("parameters.allowed_token_ids", "min_new_tokens masks all of them (EOS, stop ids)")


def refuse(param: str, message: str) -> NoReturn:
    raise RequestRejected(RequestError.refused(param, message))
