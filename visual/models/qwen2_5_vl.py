"""Qwen2.5-VL's vision tower + 2x2 patch merger: transformers' own module (RMSNorm blocks, SwiGLU MLP, window
attention except in `fullatt_block_indexes`, merger to `out_hidden_size`) with the checkpoint's vision weights, and
the same dynamic-resolution image processor as Qwen2-VL (`Qwen2VLImageProcessor`, min/max pixels).

As for Qwen2-VL, every image of a batch is one packed token sequence through transformers' blocks, with our
attention layers (`visual/models/fused_layers.py`). The tower reorders each image's merged tokens window by
window; the full-attention blocks attend within each image (`cu_seqlens`), the others within each window
(`cu_window_seqlens`), and the merger's output is put back in row-major order. The window order, both boundary lists
and the rotary position ids are built on the host from the grids (cached per grid size) and passed to the tower, so
the device does no per-image work and nothing syncs before the end of the batch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.vision_utils import get_vision_window_index

from visual.models.qwen2_vl import Qwen2VLVisionModel


@dataclass(frozen=True)
class WindowIndex:
    """The tower's window order of a batch (transformers' `get_vision_window_index` on the batch's grids)."""

    window_index: torch.Tensor  # [merged tokens] long: merged-token order, window by window, image by image
    cu_window_seqlens: torch.Tensor  # [windows + 1] int32: patch boundaries of the windows (in that order)
    max_window_seqlen: int


def window_index(
    grids: Sequence[tuple[int, int, int]], merge_size: int, window_size: int, patch_size: int
) -> WindowIndex:
    """transformers' window index of a batch, assembled from per-grid pieces (images never share a window)."""
    indices, bounds = [], [torch.zeros(1, dtype=torch.int32)]
    tokens = patches = 0
    for grid in grids:
        index, cu = _grid_window_index(tuple(grid), merge_size, window_size, patch_size)
        indices.append(index + tokens)
        bounds.append(cu[1:] + patches)
        t, h, w = grid
        tokens += t * h * w // merge_size**2
        patches += t * h * w
    cu = torch.cat(bounds)
    return WindowIndex(torch.cat(indices), cu, int((cu[1:] - cu[:-1]).max()))


@functools.lru_cache(maxsize=256)
def _grid_window_index(
    grid: tuple[int, int, int], merge_size: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (window_index, cu_window_seqlens), from 0. Cached: under load most images share a few grid sizes."""
    index, cu = get_vision_window_index(torch.tensor([grid]), merge_size, window_size, patch_size)
    return index, cu.to(torch.int32)


class Qwen2_5_VLVisionModel(Qwen2VLVisionModel):
    """Qwen2-VL's wrapper (loading, preprocessing, token counts, batching) around the Qwen2.5-VL tower."""

    tower_class = Qwen2_5_VisionTransformerPretrainedModel
    family = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"

    def __init__(
        self,
        tower: Qwen2_5_VisionTransformerPretrainedModel,
        processor: Qwen2VLImageProcessor,
        cache_salt: str,
        video_processor: Qwen2VLVideoProcessor | None = None,
    ) -> None:
        super().__init__(tower, processor, cache_salt, video_processor)
        self.hidden_size = tower.config.out_hidden_size  # the merger's output: the LLM's width
        self.window_size: int = tower.config.window_size
        self.patch_size: int = tower.config.patch_size

    def tower_inputs(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> dict:
        windows = window_index(grids, self.merge_size, self.window_size, self.patch_size)  # on the host, no sync
        return dict(
            **self.packed_inputs(grids, device),
            window_index=windows.window_index.to(device, non_blocking=True),
            cu_window_seqlens=windows.cu_window_seqlens.to(device, non_blocking=True),
            max_window_seqlen=windows.max_window_seqlen,
        )  # the tower's output: [sum of tokens, out_hidden_size], row-major per image again
