"""Qwen3-VL's language model (dense): the Qwen3 decoder (q/k RMSNorm per head, no q/k/v bias, explicit head_dim) with
interleaved M-RoPE, and DeepStack.

M-RoPE positions for images are Qwen2-VL's (temporal index 0, rows and columns of the merged grid, the text after an
image resuming at the grid's largest side); only the way the rotary bands are assigned to the three axes changes
(interleaved t, h, w: `LMConfig.mrope_interleaved`).

DeepStack: the vision tower also emits features from `deepstack_visual_indexes` of its blocks; HF adds the j-th of
them to the hidden states of the image tokens after decoder layer j. Each image token's embedding row here carries
them beside the main embedding, [main | deepstack_0 | ... | deepstack_{k-1}] ((1 + k) * hidden columns: what the
visual process writes into the cache entry), so every engine path that moves image rows (chunked prefill, the prefix
cache, the splice) carries them unchanged; only this forward splits the columns."""

from __future__ import annotations

import torch

from language.config import LMConfig
from language.forward_batch import ForwardBatch
from language.models.hf_config import lm_config_from_hf
from language.models.qwen2_vl import Qwen2VLForCausalLM


class Qwen3VLForCausalLM(Qwen2VLForCausalLM):
    """Tensor names as published: `model.language_model.*` and `lm_head.*` (the tower, `model.visual.*`, skipped);
    prepare_request (M-RoPE positions from the image grids) is Qwen2-VL's."""

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        text = raw_config.get("text_config") or raw_config
        return lm_config_from_hf(model_dir, raw_config, qkv_bias=bool(text.get("attention_bias", False)), qk_norm=True)

    @property
    def num_deepstack(self) -> int:
        """k: the tower layers whose features are added after decoder layers 0 .. k-1 (the loader sets raw_config)."""
        vision = self.raw_config.get("vision_config") or {}
        return len(vision.get("deepstack_visual_indexes") or ())

    @property
    def mm_embed_width(self) -> int:
        return (1 + self.num_deepstack) * self.cfg.hidden_size

    def layers_only(self, batch: ForwardBatch) -> bool:
        return batch.mm_embeds is None or self.num_deepstack == 0  # DeepStack adds features between layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, cos, sin = self.embed(batch)  # [num_tokens, hidden], the main embeddings spliced in
        hidden = self.cfg.hidden_size
        deepstack: list[torch.Tensor] = []
        if batch.mm_embeds is not None:  # [M, (1 + k) * hidden]
            deepstack = [batch.mm_embeds[:, (j + 1) * hidden : (j + 2) * hidden] for j in range(self.num_deepstack)]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch)
            if i < len(deepstack):
                add_deepstack(x, residual, deepstack[i], batch.mm_positions)
        return self.logits(x, residual, batch)


def add_deepstack(x: torch.Tensor, residual: torch.Tensor, features: torch.Tensor, rows: torch.Tensor) -> None:
    """After a decoder layer whose hidden state is residual + x ([N, hidden] each; the sum is fused into the next
    norm), add `features` [M, hidden] at `rows` [M], in place, rounding as HF does ((residual + x) + features): the
    image rows' sum is taken here into the residual and their x zeroed, so the next norm adds 0 to it."""
    summed = residual[rows] + x[rows]  # [M, hidden]
    residual[rows] = summed + features.to(summed.dtype)
    x[rows] = 0
