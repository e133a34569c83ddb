"""Qwen2.5-VL's vision tower + 2x2 patch merger: transformers' own module (RMSNorm blocks, SwiGLU MLP, window
attention except in `fullatt_block_indexes`, merger to `out_hidden_size`) with the checkpoint's vision weights, and
the same dynamic-resolution image processor as Qwen2-VL (`Qwen2VLImageProcessor`, min/max pixels).

As for Qwen2-VL, every image of a batch is one packed token sequence through transformers' blocks, with our varlen
attention function (`visual/models/packed_attention.py`). The tower reorders each image's merged tokens window by
window; the full-attention blocks attend within each image (`cu_seqlens`), the others within each window
(`cu_window_seqlens`), and the merger's output is put back in row-major order. The window order, both boundary lists
and the rotary position ids are built on the host from the grids (cached per grid size) and passed to the tower, so
the device does no per-image work and nothing syncs before the end of the batch."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.vision_utils import get_vision_window_index

from visual.models.base import ImageInput, register_vision_model
from visual.models.packed_attention import pack_index
from visual.models.qwen2_vl import VISION_PREFIXES, Qwen2VLVisionModel
from visual.models.weights import load_prefixed_tensors


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


@register_vision_model("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLVisionModel(Qwen2VLVisionModel):
    """Qwen2-VL's wrapper (preprocessing, token counts, batching) around the Qwen2.5-VL tower."""

    def __init__(
        self,
        tower: Qwen2_5_VisionTransformerPretrainedModel,
        processor: Qwen2VLImageProcessor,
        cache_salt: str,
    ) -> None:
        super().__init__(tower, processor, cache_salt)
        self.hidden_size = tower.config.out_hidden_size  # the merger's output: the LLM's width
        self.window_size: int = tower.config.window_size
        self.patch_size: int = tower.config.patch_size

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype) -> Qwen2_5_VLVisionModel:
        config = AutoConfig.from_pretrained(model_dir)  # flat (published) or nested (transformers 5) config.json
        # Reads preprocessor_config.json, or processor_config.json's nested "image_processor".
        processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        # Built on the target device so that the (overwritten) random init is fast for 7B-sized towers.
        with torch.device(device):
            tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=dtype)
        state = load_prefixed_tensors(model_dir, VISION_PREFIXES)
        missing, unexpected = tower.load_state_dict(state, strict=False)
        missing = [k for k in missing if "inv_freq" not in k]  # the rotary table is computed, not stored
        if missing or unexpected:
            raise ValueError(
                f"Qwen2.5-VL vision weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        size = processor.size
        salt = json.dumps(
            ["qwen2_5_vl", os.path.realpath(model_dir), size.shortest_edge, size.longest_edge, str(dtype)]
        )
        return cls(tower.to(device=device, dtype=dtype), processor, salt)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        weight = self.tower.patch_embed.proj.weight
        device, dtype = weight.device, weight.dtype
        grids = [im.grid_thw for im in images]
        # On the host: no per-image device work, no sync.
        index = pack_index(grids, self.merge_size)
        windows = window_index(grids, self.merge_size, self.window_size, self.patch_size)
        # One gather into a (pinned) host buffer, one asynchronous upload, the cast on the device.
        host = self._pixels.cat([im.pixel_values for im in images], device)  # [patches, C*T*P*P]
        pixels = host.to(device, non_blocking=True).to(dtype)
        self._pixels.fence(device)  # the next batch's gather waits for this upload
        merged = self.tower(
            pixels,
            grid_thw=torch.tensor(grids),  # [images, 3]; unused by the tower when the indexes below are given
            cu_seqlens=index.cu_seqlens.to(device, non_blocking=True),
            max_seqlen=index.max_seqlen,
            position_ids=index.position_ids.to(device, non_blocking=True),
            window_index=windows.window_index.to(device, non_blocking=True),
            cu_window_seqlens=windows.cu_window_seqlens.to(device, non_blocking=True),
            max_window_seqlen=windows.max_window_seqlen,
        ).pooler_output  # [sum of tokens, out_hidden_size], row-major per image again
        return list(torch.split(merged, [im.num_tokens for im in images]))
