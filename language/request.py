"""A request as the engine sees it: token ids in, token ids out, and the KV slots it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from language.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class MultimodalItem:
    """The embeddings of one image, placed at `offset` in the prompt (its placeholder tokens)."""

    offset: int  # index of the first placeholder token in prompt_ids
    embeds: torch.Tensor  # [num_tokens, hidden], usually a view on the shared-memory cache
    key: str = ""  # the embedding cache key, so the owner can release it
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL patch grid, for M-RoPE positions

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    # Explicit positions for models with multi-axis rotary (M-RoPE): [3, prompt_len], and the offset that decode
    # positions carry (position = seq_len - 1 + position_delta). None means plain 0..L-1 positions.
    positions: torch.Tensor | None = None
    position_delta: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    req_idx: int = -1  # row in the request-to-slots table while running

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are (or are about to be) in the cache."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        """Upper bound on the tokens this request may still add (the router's peak projection uses it)."""
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def max_total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    output_tokens: int
