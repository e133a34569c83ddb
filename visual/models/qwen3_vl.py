"""Qwen3-VL's vision tower (dense models): transformers' own module (SigLIP2-style LayerNorm blocks with a GELU MLP,
a learned position table bilinearly interpolated to each image's patch grid plus 2-D rotary, the 2x2 patch merger to
`out_hidden_size`, and one DeepStack merger per `deepstack_visual_indexes` block) with the checkpoint's vision
weights, and the same dynamic-resolution image processor as Qwen2-VL (`Qwen2VLImageProcessor`: 16 px patches,
min/max pixels from the preprocessor config).

Each image token's embedding row is [main | deepstack_0 | ... | deepstack_{k-1}]: (1 + k) * out_hidden_size values,
what the language model splits again (`language/models/qwen3_vl.py`). One cache entry per image thus carries every
tensor the LLM needs from it.

As for Qwen2-VL, a batch is one packed token sequence with our attention layers (`visual/models/fused_layers.py`);
what the tower derives from the grids with host syncs (cu_seqlens, rotary ids, and here the position table's
interpolation taps and weights) is built on the host, cached per grid size, and passed in."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Qwen3VLTower
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from families.qwen3_vl_video import plan_video
from visual.models.qwen2_vl import Qwen2VLVisionModel


class Qwen3VLVisionModel(Qwen2VLVisionModel):
    """Qwen2-VL's wrapper (loading, preprocessing, token counts, pixel upload) around the Qwen3-VL tower."""

    tower_class = Qwen3VLTower
    family = "qwen3_vl"
    display_name = "Qwen3-VL"
    video_processor_class = Qwen3VLVideoProcessor
    video_planner = staticmethod(plan_video)  # its own resize bounds and the prompt's per-patch timestamps

    def __init__(
        self,
        tower: Qwen3VLTower,
        processor: Qwen2VLImageProcessor,
        cache_salt: str,
        video_processor: Qwen3VLVideoProcessor | None = None,
    ) -> None:
        super().__init__(tower, processor, cache_salt, video_processor)
        self.hidden_size = tower.config.out_hidden_size  # the mergers' output: the LLM's width
        self.num_deepstack = len(tower.config.deepstack_visual_indexes)
        self.embed_width = (1 + self.num_deepstack) * self.hidden_size  # columns of each embedding row

    def tower_inputs(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> dict:
        taps, tap_weights = self.interpolation(grids)
        return dict(
            **self.packed_inputs(grids, device),
            interp_indices=taps.to(device, non_blocking=True),
            interp_weights=tap_weights.to(device, non_blocking=True),
        )

    def tower_forward(self, pixels: torch.Tensor, inputs: dict) -> torch.Tensor:
        """-> [sum of tokens, (1 + k) * out_hidden_size]: the merger's output, then each DeepStack merger's, side by
        side."""
        out = self.tower(pixels, **inputs)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)

    def interpolation(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The position table's interpolation taps [patches, 4] (long) and weights [patches, 4] (fp32) of a batch,
        in the processor's patch order: transformers' own function, per grid (cached), concatenated."""
        tower = self.tower
        parts = [
            _grid_interpolation(
                tuple(grid), tower.num_grid_per_side, tower.interpolation_mode, tower.interpolation_align_corners,
                self.merge_size,
            )
            for grid in grids
        ]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@functools.lru_cache(maxsize=256)
def _grid_interpolation(
    grid: tuple[int, int, int], side: int, mode: str, align_corners: bool, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (taps, weights). Cached: under load most images share a few grid sizes."""
    return get_vision_interpolation_indices_and_weights(
        torch.tensor([grid]), num_grid_per_side=side, mode=mode, align_corners=align_corners,
        spatial_merge_size=merge_size,
    )  # fmt: skip
