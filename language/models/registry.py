"""The protocol every decoder follows; the family table (families/table.py) names each architecture's decoder. The
engine never branches on the model type."""

from __future__ import annotations

from typing import Protocol

import torch

from language.config import LMConfig
from language.forward_batch import ForwardBatch


class CausalLM(Protocol):
    cfg: LMConfig
    position_dims: int
    mm_embed_width: int  # columns of an image-embedding row: the hidden size, (1 + k) * hidden with DeepStack
    bidirectional_images: bool  # an image's tokens see each other both ways in prefill (Gemma 3)

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    # What piecewise CUDA graphs replay (language/piecewise_graphs.py): `embed(batch)` -> (x, cos, sin), then per
    # layer `before_attention` (captured), `self_attn.attend` (eager), `after_attention` (captured), then
    # `logits(x, residual, batch)`; `layers_only(batch)` is False for a step whose forward adds work between layers.
    def layers_only(self, batch: ForwardBatch) -> bool: ...

    def prepare_request(self, req) -> None: ...

    def checkpoint_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor, or None for one this model does not load (it is then never read)."""

    def load_weights(self, weights) -> None: ...
