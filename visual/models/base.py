"""The interface every vision family implements, and the registry that maps HF `architectures[0]` to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from PIL import Image

from visual.architectures import IMAGE_ARCHITECTURES


@dataclass
class ImageInput:
    """One preprocessed image, ready for the vision tower (made on CPU in a worker pool)."""

    pixel_values: torch.Tensor  # family-specific layout, e.g. [3, 336, 336] or [num_patches, C*T*P*P]
    num_tokens: int  # embeddings this image becomes in the LLM prompt
    patches: int = 0  # positions the vision tower runs over, what its batches are budgeted in (0: num_tokens)
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: patch grid (t, h, w) before the 2x2 merge
    decode_s: float = 0.0  # the worker's time to decode the file (for the visual process's timing log)
    preprocess_s: float = 0.0  # the worker's time in the family's preprocessor
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

    def preprocess(self, image: Image.Image) -> ImageInput: ...

    # Optional: `preprocessor() -> Callable[[Image.Image], ImageInput]`, a picklable object holding no weights (e.g.
    # the HF image processor). When a family has it, `visual.preprocess.PreprocessPool` runs it in worker processes;
    # without it, `preprocess` runs in threads of the visual process. Optional too: the classmethod
    # `load_preprocessor(model_dir, vision_tower_dir) -> ` the same object, from the config files alone, so that the
    # pool's workers start (seconds each) while the tower loads.

    def num_tokens(self, width: int, height: int) -> int:
        """Embedding count for an image of this size, without preprocessing it (for prompt expansion)."""
        ...

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """A batch of images -> one [num_tokens, hidden_size] tensor per image, on the model's device (Qwen3-VL:
        [num_tokens, (1 + k) * hidden_size], the main embedding and its k DeepStack features side by side)."""
        ...


_REGISTRY: dict[str, type] = {}


def register_vision_model(*architectures: str):
    missing = sorted(set(architectures) - IMAGE_ARCHITECTURES)
    if missing:  # the server checks --enable_multimodal against that list before anything starts
        raise ValueError(f"vision models {missing} are registered but not listed in visual/architectures.py")

    def wrap(cls: type) -> type:
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return wrap


def vision_model_class(architecture: str) -> type:
    import_families()
    if architecture not in _REGISTRY:
        raise ValueError(f"no vision model for architecture {architecture!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[architecture]


def import_families() -> None:
    """Import the family modules so that their decorators run (a missing module is a family not written yet)."""
    import importlib

    for name in ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen_vl"):
        try:
            importlib.import_module(f"visual.models.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"visual.models.{name}":
                raise
