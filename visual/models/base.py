"""The interface every vision family implements; the family table (families/table.py) names each architecture's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from PIL import Image

from families import all_families, family, image_architectures


@dataclass
class ImageInput:
    """One preprocessed image, ready for the vision tower (made on CPU in a worker pool)."""

    pixel_values: torch.Tensor  # family-specific layout, e.g. [3, 336, 336] or [num_patches, C*T*P*P]
    num_tokens: int  # embeddings this image becomes in the LLM prompt
    patches: int = 0  # positions the vision tower runs over, what its batches are budgeted in (0: num_tokens)
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: patch grid (t, h, w) before the 2x2 merge
    decode_s: float = 0.0  # the worker's time to decode the file (for the visual process's timing log)
    preprocess_s: float = 0.0  # the worker's time in the family's preprocessor
    video: bool = False  # made from a video's frames
    extra: dict = field(default_factory=dict)

    @property
    def tower_rows(self) -> int:
        return self.patches or self.num_tokens


class VisionModel(Protocol):
    """Vision tower + projector of one family. `preprocess` runs on CPU in worker processes; `encode` on the
    visual process's device."""

    # Everything that changes the embedding besides the image bytes (model identity, preprocessing settings);
    # part of the embedding cache key.
    cache_salt: str
    hidden_size: int  # the LLM's hidden size: width of each embedding row (Qwen3-VL: of each of its 1 + k parts)

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype) -> VisionModel: ...

    def preprocess(self, image: Image.Image) -> ImageInput:
        """A family that tiles images (`tiles_images` in its spec) also takes the request's `max_patches` here and
        in its preprocessor's call."""
        ...

    def preprocessor(self) -> Callable[[Image.Image], ImageInput]:
        """A picklable object holding no weights (e.g. the HF image processor) doing what `preprocess` does:
        `visual.preprocess.PreprocessPool` runs it in worker processes (with no workers, `preprocess` runs in
        threads of the visual process)."""
        ...

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None) -> Callable[[Image.Image], ImageInput]:
        """`preprocessor()`'s object from the config files alone, so that the pool's workers start (seconds each)
        while the tower loads."""
        ...

    def num_tokens(self, width: int, height: int) -> int:
        """Embedding count for an image of this size, without preprocessing it (for prompt expansion)."""
        ...

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """A batch of images -> one [num_tokens, hidden_size] tensor per image, on the model's device (Qwen3-VL:
        [num_tokens, (1 + k) * hidden_size], the main embedding and its k DeepStack features side by side)."""
        ...


def vision_model_class(architecture: str) -> type:
    """The vision model class of `architecture`'s family; ValueError for one not in the table or without a tower."""
    spec = family(architecture)
    if spec.vision is None:
        raise ValueError(f"no vision model for architecture {architecture!r}; known: {image_architectures()}")
    return spec.part("vision")


def import_families() -> None:
    """Import every family's vision module (the preprocessing workers' fork server preloads them)."""
    for spec in all_families():
        if spec.vision is not None:
            spec.part("vision")
