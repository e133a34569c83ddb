"""Qwen2.5-VL's language model: the Qwen2 decoder with M-RoPE, as Qwen2-VL's. For images the 3-D positions are
Qwen2-VL's (temporal index 0, rows and columns of the merged grid); Qwen2.5-VL only changes the temporal axis of
videos (`second_per_grid_ts`), which are not served."""

from __future__ import annotations

from language.models.qwen2_vl import Qwen2VLForCausalLM


class Qwen2_5_VLForCausalLM(Qwen2VLForCausalLM):
    """Same tensor names in both dialects (`model.*` / `model.language_model.*`, `lm_head.*`, the tower skipped)."""
