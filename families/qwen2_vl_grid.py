"""Qwen2-VL's image arithmetic (also Qwen2.5-VL's and Qwen3-VL's): the patch grid the image processor produces for
an image of a given size, and the embedding count after the merger. The prompt side expands placeholders with it and
the tower side labels its inputs with it, so both always agree. transformers' `smart_resize` does the resizing."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize


@dataclass(frozen=True)
class Qwen2VLGrid:
    patch_size: int
    merge_size: int  # the merger joins merge_size x merge_size patches into one embedding
    min_pixels: int
    max_pixels: int

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size, as the image processor resizes it."""
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def grid_tokens(self, grid: tuple[int, int, int]) -> int:
        """Embeddings (placeholder tokens) of an image with this patch grid."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def num_tokens(self, width: int, height: int) -> int:
        return self.grid_tokens(self.grid_thw(width, height))
