"""Per-family prompt processors: prompt text + the request's images -> prompt token ids with every image placeholder
expanded to its embedding count, and where each image's embeddings go.

The family table (families/table.py) names each architecture's processor; the HTTP process builds one per server
(`prompt_processor_class(arch).from_pretrained(model_dir, tokenizer)`) and calls `encode` off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from families import family, image_architectures
from mmserve.prep.multimodal.image_io import BadImage

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
    # With videos (families that serve them): per entry, its index in the request's images + videos (the entries
    # above are in prompt order, images and videos interleaved), and a video's seconds per temporal patch (None for
    # an image). Empty: the entries are the images, in order.
    sources: list[int] = field(default_factory=list)
    second_per_grid_t: list[float | None] = field(default_factory=list)
    # Per entry, the first of its item's embedding rows that it takes: a video split into several runs (Qwen3-VL's
    # timestamped temporal patches) has one entry per run. Empty: every entry takes its item's rows from 0.
    row_starts: list[int] = field(default_factory=list)


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

    # Optional, declared in the family's spec (families/spec.py) where a processor has it:
    # - `check_image_size(width, height)` (checks_image_size) raises BadImage for a size the family's image processor
    #   refuses or cannot afford; the server calls it from each image's header, before anything is sent or tokenized;
    # - `image_items(prompt, sent)` (images_in_prompt): the request's images in prompt order when the prompt itself
    #   names images (Qwen-VL's `<img>path or URL</img>`), with the attributes `image_dir` (--image_dir, where paths
    #   may point) and `max_image_bytes` that the server sets.
    # - videos (`videos`): `count_videos(prompt)`, `default_video_sampling()` (the checkpoint's video processor's
    #   fps / num_frames, {} if it sets neither), `plan_video(metadata, sampling)` (families/qwen2_vl_video.py's
    #   VideoPlan; ValueError for sampling it refuses) and `encode(prompt, image_sizes, videos)` with the videos'
    #   plans in prompt order, returning `sources` and `second_per_grid_t`.


def prompt_processor_class(architecture: str) -> type:
    """The prompt processor class of `architecture`'s family; ValueError for one not in the table or text only."""
    spec = family(architecture)
    if spec.prompt is None:
        raise ValueError(f"no prompt processor for architecture {architecture!r}; known: {image_architectures()}")
    return spec.part("prompt")


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
