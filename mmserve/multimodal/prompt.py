"""Per-family prompt processors: prompt text + the request's images -> prompt token ids with every image placeholder
expanded to its embedding count, and where each image's embeddings go.

A family registers its processor under its HF `architectures[0]`; the HTTP process builds one per server
(`prompt_processor_class(arch).from_pretrained(model_dir, tokenizer)`) and calls `encode` off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from mmserve.multimodal.image_io import BadImage

# transformers' smart_resize (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) raises above it; LLaVA is held to it too (its
# processor's resize grows with the aspect ratio)
MAX_ASPECT_RATIO = 200


class PromptImageMismatch(ValueError):
    """The prompt's image placeholders do not match the images sent (the server answers 400)."""


@dataclass
class MultimodalPrompt:
    token_ids: list[int]
    offsets: list[int]  # per image: index in token_ids of its first placeholder token
    num_tokens: list[int]  # per image: placeholder tokens (= embedding rows)
    grid_thw: list[tuple[int, int, int] | None] = field(default_factory=list)  # per image (Qwen2-VL), else empty


class PromptProcessor(Protocol):
    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> PromptProcessor: ...

    def count_images(self, prompt: str) -> int:
        """Image placeholders in the prompt text."""
        ...

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        """Tokenize `prompt` (BOS as the tokenizer adds it); image_sizes are (width, height) in prompt order.
        Raises PromptImageMismatch if the placeholder count differs from len(image_sizes)."""
        ...

    # Optional: `check_image_size(width, height)` raises BadImage for a size the family's image processor refuses
    # or cannot afford; the server calls it from each image's header, before anything is sent or tokenized.


_REGISTRY: dict[str, type] = {}


def register_prompt_processor(*architectures: str):
    def wrap(cls: type) -> type:
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return wrap


def prompt_processor_class(architecture: str) -> type:
    _import_families()
    if architecture not in _REGISTRY:
        raise ValueError(f"no prompt processor for architecture {architecture!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[architecture]


def check_image_count(found: int, given: int, placeholder: str) -> None:
    if found != given:
        raise PromptImageMismatch(
            f"the prompt has {found} {placeholder} placeholder(s) but {given} image(s) were sent; "
            f"each {placeholder} stands for one image, in order"
        )


def check_aspect_ratio(width: int, height: int, limit: int, why: str) -> None:
    """BadImage if the longer side is more than `limit` times the shorter one; `why` says whose limit it is."""
    ratio = max(width, height) / min(width, height)
    if ratio > limit:
        raise BadImage(f"image is {width}x{height}: its aspect ratio {ratio:.0f}:1 is above {limit}:1, {why}")


def _import_families() -> None:
    """Import the family modules so that their decorators run (a missing module is a family not written yet)."""
    import importlib

    for name in ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen_vl"):
        try:
            importlib.import_module(f"mmserve.multimodal.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"mmserve.multimodal.{name}":
                raise
