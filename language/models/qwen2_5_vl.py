"""Qwen2.5-VL's language model: the Qwen2 decoder with M-RoPE, as Qwen2-VL's. For images the 3-D positions are
Qwen2-VL's (temporal index 0, rows and columns of the merged grid); for videos the temporal axis is absolute time:
temporal patch k sits at int(k * tokens_per_second * second_per_grid_t) (HF's get_rope_index)."""

from __future__ import annotations

from language.models.qwen2_vl import Qwen2VLForCausalLM
from language.request import MultimodalItem


class Qwen2_5_VLForCausalLM(Qwen2VLForCausalLM):
    """Same tensor names in both dialects (`model.*` / `model.language_model.*`, `lm_head.*`, the tower skipped)."""

    def video_time_interval(self, item: MultimodalItem) -> float | None:
        if item.second_per_grid_t is None:
            return None
        vision = self.raw_config.get("vision_config") or {}
        return vision.get("tokens_per_second", 25) * item.second_per_grid_t
