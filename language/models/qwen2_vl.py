"""Qwen2-VL's language model: Qwen2 (q/k/v bias, GQA) with M-RoPE, whose 3-D positions come from the prompt's
image and video grids."""

from __future__ import annotations

from language.models.llama import Qwen2ForCausalLM
from language.models.qwen2_vl_positions import mrope_positions
from language.request import MultimodalItem, Request


class Qwen2VLForCausalLM(Qwen2ForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("visual.", "model.visual.")):
            return None
        if name.startswith("model.language_model."):
            return name.removeprefix("model.language_model.")
        return super().checkpoint_name(name)

    def prepare_request(self, req: Request) -> None:
        if req.positions is not None:
            return
        grids = [item.grid_thw for item in req.mm_items]
        if any(g is None for g in grids):
            raise ValueError("Qwen2-VL images need their patch grid (grid_thw)")
        raw = self.raw_config
        vision = raw.get("vision_config") or {}
        req.positions, req.position_delta = mrope_positions(
            req.prompt_ids,
            grids,
            image_token_id=raw["image_token_id"],
            vision_start_token_id=raw["vision_start_token_id"],
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            video_token_id=raw.get("video_token_id"),
            time_intervals=[self.video_time_interval(item) for item in req.mm_items],
        )

    def video_time_interval(self, item: MultimodalItem) -> float | None:
        """How far apart a video's temporal patches sit on M-RoPE's time axis (None: an image). Qwen2-VL: one
        position per temporal patch."""
        return None if item.second_per_grid_t is None else 1.0
