"""A request as the engine sees it: token ids in, token ids out, and the KV slots it holds.

With the overlapped engine a request runs one step ahead of what the host has read back: `kv_len` and
`num_sampled` count what launched steps will have written and sampled, `output_ids` what has been collected."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from language.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without an answer, in the fields the HTTP side answers with: the status, the client's
    field at fault (None: not the request's fault, a failure of the server) and what happened."""

    status: int
    param: str | None
    message: str

    @classmethod
    def refused(cls, param: str, message: str) -> RequestError:
        return cls(400, param, message)

    @classmethod
    def server_failure(cls, message: str) -> RequestError:
        """A step that raised, an image's embeddings gone: the request did nothing wrong."""
        return cls(500, None, message)


class RequestRejected(ValueError):
    """EngineCore.add_request refused the request (nothing was added): `error` says why, for the client."""

    def __init__(self, error: RequestError):
        super().__init__(error.message if error.param is None else f"{error.param}: {error.message}")
        self.error = error


def request_limit(max_req_total_len: int, kv_slots: int) -> int:
    """The most tokens of prompt + output one request may have: it must fit both the model's context and the whole
    KV cache."""
    return min(max_req_total_len, kv_slots)


def length_error(prompt_len: int, max_new_tokens: int, limit: int) -> RequestError | None:
    """The one rule on a request's length (`limit`: request_limit): the prompt leaves room for one new token, and
    prompt + max_new_tokens fits."""
    if prompt_len >= limit:
        message = f"the prompt is {prompt_len} tokens; this server allows {limit - 1} at most"
        return RequestError.refused("inputs", message)
    if prompt_len + max_new_tokens > limit:
        return RequestError.refused(
            "parameters.max_new_tokens",
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds this server's limit of {limit} "
            "tokens per request",
        )
    return None


class PrefixNotCached(ValueError):
    """EngineCore.add_request: the request has images without embeddings whose KV the prefix cache does not hold
    (any more). Nothing was added; send it again with the embeddings."""


@dataclass
class MultimodalItem:
    """The embeddings of one image, placed at `offset` in the prompt (its placeholder tokens). `embeds` may be None
    (then `length` gives the placeholder count) for an image whose KV the prefix cache holds: the request is then
    admitted only if its cached prefix covers the image (EngineCore.add_request), so its rows are never read."""

    offset: int  # index of the first placeholder token in prompt_ids
    embeds: torch.Tensor | None  # [num_tokens, hidden], usually a view on the shared-memory cache
    key: str = ""  # the embedding cache key, so the owner can release it
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL patch grid, for M-RoPE positions
    length: int = 0  # placeholder tokens, when there are no embeddings
    second_per_grid_t: float | None = None  # a video's seconds per temporal patch (M-RoPE time axis); None: an image
    row_start: int = 0  # the first of its cache entry's rows it holds (one of a video's runs: Qwen3-VL); in its key

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0] if self.embeds is not None else self.length


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    # Explicit positions for models with multi-axis rotary (M-RoPE): [3, prompt_len], and the offset that decode
    # positions carry (position = token index + position_delta). None means plain 0..L-1 positions.
    positions: torch.Tensor | None = None
    position_delta: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)  # collected from finished steps
    output_logprobs: list[float] = field(default_factory=list)
    # prompt_logprobs asked: what the prefill chunks have scored so far (positions 1.. of the prompt)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    req_idx: int = -1  # row in the request-to-slots table while running
    # What launched steps (including the one in flight) have done:
    kv_len: int = 0  # tokens whose K/V are written: prompt chunks, then one sampled token per decode step
    num_sampled: int = 0  # tokens sampled (the first one by the prompt's last chunk)
    kv_slots: list[int] = field(default_factory=list)  # slot of token i at index i (host mirror of the table row)
    # Prefix cache: the prompt as the tree keys it (None: this request neither reuses nor shares KV), the first
    # `cached_len` slots belong to the tree on the path to `prefix_node` (locked while running), and how many prompt
    # tokens came from the cache at admission.
    cache_ids: list[int] | None = None
    cached_len: int = 0
    prefix_node: object | None = None
    prompt_cache_len: int = 0
    # While waiting: the cached prefix locked at arrival because it holds the KV of images sent without embeddings.
    reserved_node: object | None = None
    # Structured output: its xgrammar GrammarMatcher, from the time its grammar has compiled until it finishes
    grammar: object | None = None
    logit_edits: object | None = None  # the sampler's edits that no step changes, built on its first (sampler.py)
    scheduled_at: float | None = None  # time.monotonic() at admission (RequestOutput.scheduled_at)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Tokens known to the host: the prompt and the collected outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is still to be run (chunked prefill)."""
        return self.kv_len < self.prompt_len

    @property
    def sampling_done(self) -> bool:
        """Launched steps already sample every token max_new_tokens allows: no further step is needed."""
        return self.num_sampled >= self.params.max_new_tokens

    @property
    def max_total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class PromptLogprobs:
    """The prompt scored by the model: logprobs[i] = log P(token_ids[i + 1] | token_ids[: i + 1]) (the first token
    has none), from the log-softmax of the raw logits; `top[i]` the k most likely tokens there when k > 0 was asked.
    Image placeholder positions are scored like any other: the placeholder id's log-probability (as HF's and vLLM's
    forward logits give it), and the position after an image scores the text token that follows it."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # [len(token_ids) - 1] once complete
    top: list[TopLogprobs] | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request. The router sends it to the detokenizer as it is (plain values,
    no tensors), and makes its own for requests that never reach the engine (refused, aborted while waiting)."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    new_top_logprobs: list[TopLogprobs] | None = None  # per new token, when top_logprobs > 0 was asked
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when prompt_logprobs was asked
    error: RequestError | None = None  # why it ended with finish_reason "error"
    # time.monotonic() when the scheduler admitted the request (None before): the end of its queue time. It is
    # CLOCK_MONOTONIC, one clock for every process of the host: the HTTP process compares it with its arrival time.
    scheduled_at: float | None = None
