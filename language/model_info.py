"""What the engine tells its callers about the model it serves (the HTTP side's limits, the router's checks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from language.request import request_limit


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    mm_embed_width: int  # columns of an image-embedding row (the hidden size, or more: Qwen3-VL's DeepStack)
    dtype: torch.dtype
    device: torch.device
    max_total_token_num: int
    max_req_total_len: int

    @property
    def request_limit(self) -> int:
        return request_limit(self.max_req_total_len, self.max_total_token_num)
