"""The HTTP API's JSON, as LightLLM's: request parsing and validation, response and stream-event shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from language.request import PromptLogprobs, RequestError
from language.sampling_params import MAX_TOP_LOGPROBS, InvalidParams, SamplingParams
from mmserve.http import json_body
from mmserve.http.structured import LIGHTLLM_KINDS, lightllm_constraint, with_constraint
from mmserve.ipc.messages import TokenDetail

PARAMETER_NAMES = frozenset(
    {
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "min_p",  # vLLM's (HF's MinPLogitsWarper); not LightLLM's
        "max_new_tokens",
        "stop_sequences",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "return_details",
        "disable_prompt_cache",
        "n",
        "best_of",
        "min_new_tokens",
        "allowed_token_ids",
        "logit_bias",
        "exponential_decay_length_penalty",
        "input_penalty",
        "skip_special_tokens",
        "add_special_tokens",
        "add_spaces_between_special_tokens",
        "print_eos_token",
        "include_stop_str_in_output",  # vLLM's; not LightLLM's
        # Accepted and ignored: LightLLM's InternVL knob (no family here tiles images), and its request-group id
        # (LightLLM's own n/best_of bookkeeping; here the HTTP side groups sub-requests itself).
        "image_max_patch_num",
        "group_request_id",
        # Each prompt token's log-probability given its prefix: true or k (0..20 alternatives per position, as
        # vLLM's prompt_logprobs); answered in LightLLM's shape (prompt_token_ids, prompt_logprobs).
        "prompt_logprobs",
        *LIGHTLLM_KINDS,  # the output constraint (structured.py): guided_json, regular_constraint, guided_grammar
    }
)
MAX_IMAGE_PATCHES = 64  # the most tiles image_max_patch_num may ask for (InternVL publishes 12; its docs go to 40)
TOP_LEVEL_NAMES = frozenset({"inputs", "input", "parameters", "multimodal_params"})


class BadRequest(Exception):
    """A client error, answered with 400 and a JSON body naming the offending field."""

    def __init__(self, field_name: str, message: str, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.status = status

    @classmethod
    def of(cls, error: RequestError) -> BadRequest:
        """A request the router or the engine refused or failed, answered as the HTTP side's own refusals are; one
        that is not the request's fault names the "server"."""
        return cls(error.param or "server", error.message, error.status)

    def to_error(self) -> RequestError:
        return RequestError(self.status, self.field, self.message)

    def to_json(self) -> dict:
        return {"error": str(self), "field": self.field}


class ServerFailure(Exception):
    """The server cannot complete the request: a child process died, or a part it needs is down (answered 503)."""


@dataclass(frozen=True)
class GenerateInput:
    prompt: str
    params: SamplingParams
    multimodal_params: dict = field(default_factory=dict)
    # No max_new_tokens given (an OpenAI chat without max_tokens): generate up to what the context leaves, which only
    # the preparer knows once the prompt (with its images) is tokenized.
    fill_context: bool = False
    # A prompt sent as token ids (OpenAI's /v1/completions): run as they are, never tokenized; `prompt` then holds
    # their text (for echo, and the image placeholder check of a multimodal server).
    prompt_ids: tuple[int, ...] | None = None
    # LightLLM's `image_max_patch_num`: the tile cap of a family that tiles images (InternVL); -1: the checkpoint's
    image_max_patch_num: int = -1


_TOO_DEEP = f"is nested too deeply (arrays and objects at most {json_body.MAX_DEPTH} levels deep)"


def parse_json(raw: bytes) -> dict:
    """A request body that must be one JSON object; BadRequest otherwise."""
    try:
        body = json_body.loads(raw)  # json.loads, with image payloads cut out first
    except (json_body.TooDeep, RecursionError):  # RecursionError: json.loads's own limit (~1000 levels on 3.11)
        raise BadRequest("body", _TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    surrogate = json_body.lone_surrogate(body, raw)
    if surrogate is not None:
        where, text = surrogate
        raise BadRequest(where, f"holds a lone surrogate, which is not valid Unicode text: {text[:80]}")
    return body


def parse_generate_body(raw: bytes) -> GenerateInput:
    body = parse_json(raw)
    for name in body:
        if name not in TOP_LEVEL_NAMES:
            raise BadRequest(name, f"unknown field (expected {sorted(TOP_LEVEL_NAMES)})")
    prompt = body["inputs"] if "inputs" in body else body.get("input")
    if prompt is None:
        raise BadRequest("inputs", "is required")
    if not isinstance(prompt, str):
        raise BadRequest("inputs", "must be a string")
    if not prompt:
        raise BadRequest("inputs", "must not be empty")
    mm = body.get("multimodal_params") or {}
    if not isinstance(mm, dict):
        raise BadRequest("multimodal_params", "must be a JSON object")
    parameters = body.get("parameters")
    patches = image_max_patch_num(parameters.get("image_max_patch_num") if isinstance(parameters, dict) else None)
    return GenerateInput(prompt, parse_parameters(parameters), mm, image_max_patch_num=patches)


def parse_parameters(raw: object) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("parameters", "must be a JSON object")
    for name in raw:
        if name not in PARAMETER_NAMES:
            raise BadRequest(f"parameters.{name}", "unknown parameter")
    kwargs = {k: v for k, v in raw.items() if k not in LIGHTLLM_KINDS}
    _check_ignored(kwargs)
    _convert_lists(kwargs)
    for name in ("n", "best_of", "min_new_tokens", "add_special_tokens"):
        if kwargs.get(name, 0) is None:  # null: the default
            del kwargs[name]
    if "prompt_logprobs" in kwargs:
        kwargs["prompt_logprobs"] = prompt_logprobs_count(kwargs["prompt_logprobs"], "parameters.prompt_logprobs")
    if "stop_sequences" in kwargs:
        kwargs["stop_sequences"] = _string_tuple("stop_sequences", kwargs["stop_sequences"])
    if "stop_token_ids" in kwargs:
        ids = kwargs["stop_token_ids"]
        if not isinstance(ids, list):
            raise BadRequest("parameters.stop_token_ids", "must be a list of token ids")
        kwargs["stop_token_ids"] = tuple(ids)
    if "return_details" in kwargs and not isinstance(kwargs["return_details"], bool):
        raise BadRequest("parameters.return_details", "must be a boolean")
    try:
        params = SamplingParams(**kwargs).validate()
    except InvalidParams as e:
        raise BadRequest(f"parameters.{e.field}", str(e).split(": ", 1)[-1]) from None
    try:  # its errors name the client's field in full (parameters.guided_json)
        return with_constraint(params, lightllm_constraint(raw), "parameters.")
    except InvalidParams as e:
        raise BadRequest(e.field, e.message) from None


def prompt_logprobs_count(value: object, field_name: str) -> int | None:
    """null / false: off; true: each prompt token's own log-probability; k: that and the k most likely tokens."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(field_name, f"must be null, a boolean or an integer in [0, {MAX_TOP_LOGPROBS}]")
    return value


def image_max_patch_num(value: object) -> int:
    """LightLLM's InternVL tiling cap: -1 (or null) for the checkpoint's own, else 0..MAX_IMAGE_PATCHES tiles (the
    image processor's grid search is quadratic in it)."""
    if value is None:
        return -1
    if not _is_int(value) or not -1 <= value <= MAX_IMAGE_PATCHES:
        raise BadRequest("parameters.image_max_patch_num", f"must be -1 or an integer in [0, {MAX_IMAGE_PATCHES}]")
    return value


def _check_ignored(kwargs: dict) -> None:
    """image_max_patch_num (validated, then carried by GenerateInput: it is not a sampling parameter) and
    group_request_id (validated and dropped: it means nothing here) leave the sampling parameters."""
    image_max_patch_num(kwargs.pop("image_max_patch_num", None))
    group = kwargs.pop("group_request_id", None)
    if group is not None and not _is_int(group):
        raise BadRequest("parameters.group_request_id", "must be an integer")


def _convert_lists(kwargs: dict) -> None:
    """JSON lists and objects -> the tuples SamplingParams holds."""
    if "allowed_token_ids" in kwargs and kwargs["allowed_token_ids"] is not None:
        ids = kwargs["allowed_token_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            raise BadRequest("parameters.allowed_token_ids", "must be a non-empty list of token ids")
        kwargs["allowed_token_ids"] = tuple(sorted(set(ids)))
    if "logit_bias" in kwargs:
        bias = kwargs["logit_bias"]
        if bias is None:
            bias = {}
        if not isinstance(bias, dict):
            raise BadRequest("parameters.logit_bias", "must be an object mapping token ids to biases")
        pairs = []
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest("parameters.logit_bias", f"key {key!r} is not a token id") from None
            pairs.append((token, value))
        kwargs["logit_bias"] = tuple(sorted(pairs))
    if "exponential_decay_length_penalty" in kwargs and kwargs["exponential_decay_length_penalty"] is not None:
        decay = kwargs["exponential_decay_length_penalty"]
        if not isinstance(decay, list) or len(decay) != 2:
            raise BadRequest("parameters.exponential_decay_length_penalty", "must be [start_index, decay_factor]")
        kwargs["exponential_decay_length_penalty"] = tuple(decay)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _string_tuple(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(f"parameters.{name}", "must be a non-empty string or a list of non-empty strings")
    return tuple(value)


# ------------------------------------------------------------------------------------------------- responses


LOGPROB_FLOOR = -9999.0  # -inf (a masked token among the alternatives) as vLLM sends it: JSON has no infinity


def json_logprob(logprob: float | None) -> float | None:
    """A log-probability as JSON can carry it: -inf becomes LOGPROB_FLOOR. NaN cannot come from a validated
    request; if it did, it would become the floor too (NaN compares false) rather than break the response."""
    if logprob is None:
        return None
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_json(t: TokenDetail, count: int, prompt_tokens: int) -> dict:
    """One entry of `tokens` (return_details): LightLLM's token metadata; `count` is count_output_tokens there."""
    return {
        "id": t.id,
        "text": t.text,
        "logprob": json_logprob(t.logprob),
        "special": t.special,
        "count_output_tokens": count,
        "prompt_tokens": prompt_tokens,
    }


def input_usage(prompt_tokens: int, image_tokens: int) -> dict:
    """LightLLM's count of the prompt's tokens by kind (no family here takes audio)."""
    return {
        "input_text_tokens": prompt_tokens - image_tokens,
        "input_audio_tokens": 0,
        "input_image_tokens": image_tokens,
    }


def token_logprobs_json(t: TokenDetail) -> dict:
    """LightLLM's `logprobs` of one token: {id: {logprob, rank, decoded_token}}. The sampled token's rank is not
    computed here (LightLLM sends null too unless its sampler reported one); decoded_token is the text the token
    completed (LightLLM decodes the token alone)."""
    return {str(t.id): {"logprob": json_logprob(t.logprob), "rank": None, "decoded_token": t.text}}


def prompt_logprobs_json(scores: PromptLogprobs) -> dict:
    """LightLLM's shape (its --return_all_prompt_logprobs): `prompt_token_ids`, and `prompt_logprobs` as one
    [token_id, {next_token_id: logprob}] pair per prompt position but the last, the next token's log-probability
    given the prompt up to and including token_id; with k alternatives asked, the dict holds them too."""
    ids, top = scores.token_ids, scores.top
    pairs = []
    for i, logprob in enumerate(scores.logprobs):
        entry = {str(ids[i + 1]): json_logprob(logprob)}  # the prompt's own next token first
        for t, lp in top[i] if top is not None else ():
            entry.setdefault(str(t), json_logprob(lp))
        pairs.append([ids[i], entry])
    return {"prompt_token_ids": ids, "prompt_logprobs": pairs}


def generate_response(
    text: str,
    tokens: list[TokenDetail],
    finish_reason: str | None,
    prompt_tokens: int,
    output_tokens: int,
    return_details: bool,
    prompt_cache_len: int = 0,
    prompt_logprobs: PromptLogprobs | None = None,
    image_tokens: int = 0,
) -> dict:
    """/generate's answer, as LightLLM's: `generated_text` is always a list; `logprobs` one entry per token."""
    out = {
        "generated_text": [text],
        "count_output_tokens": output_tokens,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
    }
    if return_details:
        out["tokens"] = [token_json(t, i + 1, prompt_tokens) for i, t in enumerate(tokens)]
        out["prompt_cache_len"] = prompt_cache_len  # prompt tokens whose KV came from the prefix cache
    out["logprobs"] = [token_logprobs_json(t) for t in tokens]
    if prompt_logprobs is not None:
        out.update(prompt_logprobs_json(prompt_logprobs))
    out["input_usage"] = input_usage(prompt_tokens, image_tokens)
    return out


def generate_group_response(results: list, return_details: bool, image_tokens: int = 0) -> dict:
    """n > 1, as LightLLM: generated_text, count_output_tokens, finish_reason, logprobs (and tokens) are lists, one
    entry per sequence. results: (last TextOutput, text, tokens) per sequence."""
    first = results[0][0]
    out = {
        "generated_text": [text for _, text, _ in results],
        "count_output_tokens": [o.output_tokens for o, _, _ in results],
        "finish_reason": [o.finish_reason for o, _, _ in results],
        "prompt_tokens": first.prompt_tokens,
    }
    if return_details:
        out["tokens"] = [[token_json(t, i + 1, o.prompt_tokens) for i, t in enumerate(ts)] for o, _, ts in results]
        out["prompt_cache_len"] = [o.cached_tokens for o, _, _ in results]
    out["logprobs"] = [[token_logprobs_json(t) for t in tokens] for _, _, tokens in results]
    scores = next((o.prompt_logprobs for o, _, _ in results if o.prompt_logprobs is not None), None)
    if scores is not None:
        out.update(prompt_logprobs_json(scores))
    out["input_usage"] = input_usage(first.prompt_tokens, image_tokens)
    return out


def error_event(message: str) -> str:
    return f"data:{json.dumps({'error': message, 'finished': True, 'finish_reason': 'error'})}\n\n"
