"""What the OpenAI routes take beyond OpenAI's own fields, as vLLM takes it: the extra sampling fields that /generate's
`parameters` already run (vLLM's names, and LightLLM's do_sample), and /v1/completions' prompt in each of its forms
(a string, a list of strings, a token-id list, a list of token-id lists)."""

from __future__ import annotations

from language.sampling_params import MAX_SEQUENCES
from mmserve.http.protocol import BadRequest, prompt_logprobs_count

# vLLM's extra sampling fields (and LightLLM's do_sample), each the SamplingParams field it sets
EXTRA_FIELDS = {
    "logit_bias": "logit_bias",  # OpenAI's own, run by the same sampler path as /generate's
    "best_of": "best_of",
    "stop_token_ids": "stop_token_ids",
    "min_tokens": "min_new_tokens",
    "allowed_token_ids": "allowed_token_ids",
    "prompt_logprobs": "prompt_logprobs",
    "do_sample": "do_sample",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "add_spaces_between_special_tokens",
    "add_special_tokens": "add_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
EXTRA_NAMES = frozenset(EXTRA_FIELDS)
# vLLM's /tokenize (a prompt, or chat messages) and /detokenize bodies
TOKENIZE_NAMES = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_NAMES = frozenset(
    {"model", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt", "chat_template_kwargs"}
)
DETOKENIZE_NAMES = frozenset({"model", "tokens"})
# One request's engine sequences at most: its prompts times best_of (or n).
MAX_BATCH_SEQUENCES = 8 * MAX_SEQUENCES


def extra_kwargs(body: dict) -> dict:
    """The extra fields the body sets (null: unset) -> SamplingParams keyword arguments, their JSON lists and
    objects made the tuples SamplingParams holds; the ranges are SamplingParams.validate's."""
    kwargs = {EXTRA_FIELDS[name]: body[name] for name in EXTRA_FIELDS if body.get(name) is not None}
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = _bias_pairs(kwargs["logit_bias"])
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = _token_ids(kwargs["stop_token_ids"], "stop_token_ids", empty_ok=True)
    if "allowed_token_ids" in kwargs:
        kwargs["allowed_token_ids"] = tuple(sorted(set(_token_ids(kwargs["allowed_token_ids"], "allowed_token_ids"))))
    if "prompt_logprobs" in kwargs:
        kwargs["prompt_logprobs"] = prompt_logprobs_count(kwargs["prompt_logprobs"], "prompt_logprobs")
        if body.get("stream"):  # as vLLM: the prompt's scores come in the whole answer only
            raise BadRequest("prompt_logprobs", "is not available with stream: true")
    return kwargs


def _bias_pairs(bias: object) -> tuple[tuple[int, object], ...]:
    """OpenAI's {"<token id>": bias} -> sorted (id, bias) pairs."""
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias", "must be an object mapping token ids to biases in [-100, 100]")
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest("logit_bias", f"key {key!r} is not a token id") from None
        pairs.append((token, value))
    return tuple(sorted(pairs))


def _token_ids(ids: object, name: str, empty_ok: bool = False) -> tuple[int, ...]:
    if not isinstance(ids, list) or not (ids or empty_ok) or not all(_is_int(t) for t in ids):
        raise BadRequest(name, "must be a " + ("" if empty_ok else "non-empty ") + "list of token ids")
    return tuple(ids)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------- prompts

_PROMPT_FORMS = "a non-empty string, a list of strings, a list of token ids or a list of token-id lists"


def completion_prompts(body: dict, vocab_size: int) -> list[str | tuple[int, ...]]:
    """/v1/completions' prompt -> its prompts in order, each a string or a tuple of token ids (every id in the
    tokenizer's vocabulary). One choice per prompt (times n) comes back, in this order."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise BadRequest("prompt", f"must be {_PROMPT_FORMS}")
    out: list[str | tuple[int, ...]] = []
    for i, one in enumerate(prompts):
        where = "" if len(prompts) == 1 else f"prompt {i}: "
        if isinstance(one, str) and one:
            out.append(one)
        elif isinstance(one, list) and one and all(_is_int(t) for t in one):
            outside = sorted({t for t in one if not 0 <= t < vocab_size})
            if outside:
                raise BadRequest("prompt", f"{where}token ids {outside[:8]} are out of the vocabulary (size "
                                 f"{vocab_size})")  # fmt: skip
            out.append(tuple(one))
        else:
            raise BadRequest("prompt", f"{where}must be a non-empty string or a non-empty list of token ids")
    return out


def check_batch_size(prompts: int, sequences_each: int) -> None:
    if prompts * sequences_each > MAX_BATCH_SEQUENCES:
        raise BadRequest("prompt", f"{prompts} prompts x {sequences_each} sequences each is more than the "
                         f"{MAX_BATCH_SEQUENCES} sequences one request may run")  # fmt: skip
