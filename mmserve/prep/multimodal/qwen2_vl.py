"""Qwen2-VL prompts: each `<|image_pad|>` (written as `<|vision_start|><|image_pad|><|vision_end|>`) expands to its
image's token count, which dynamic resolution makes size-dependent; the prompt also gets its 3-D M-RoPE positions.

The image processor's `smart_resize` refuses an aspect ratio above 200:1 (it raises, in transformers' Qwen2-VL,
Qwen2.5-VL and Qwen3-VL processors alike): `check_image_size` refuses such an image from its header, with a 400,
before the prompt is expanded or anything is encoded."""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedTokenizerBase, Qwen2VLImageProcessor

from families.qwen2_vl_grid import Qwen2VLGrid
from mmserve.http.protocol import BadRequest
from mmserve.prep.multimodal.prompt import (
    MAX_ASPECT_RATIO,
    MultimodalPrompt,
    check_aspect_ratio,
    check_image_count,
)

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"  # the chat template's video placeholder: rejected with a 400


class Qwen2VLPromptProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_token_id: int,
        vision_start_token_id: int,
        patch_size: int,
        merge_size: int,
        min_pixels: int,
        max_pixels: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.grid = Qwen2VLGrid(patch_size, merge_size, min_pixels, max_pixels)

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> Qwen2VLPromptProcessor:
        config = AutoConfig.from_pretrained(model_dir)
        processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        return cls(
            tokenizer,
            config.image_token_id,
            config.vision_start_token_id,
            processor.patch_size,
            processor.merge_size,
            processor.size.shortest_edge,
            processor.size.longest_edge,
        )

    def check_image_size(self, width: int, height: int) -> None:
        check_aspect_ratio(width, height, MAX_ASPECT_RATIO, "the most this model's image processor accepts")

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid the image processor will produce for an image of this size (it resizes the same way)."""
        return self.grid.grid_thw(width, height)

    def count_images(self, prompt: str) -> int:
        if VIDEO_PAD in prompt:
            raise BadRequest("inputs", f"video input is not supported: the prompt has {VIDEO_PAD} (images only)")
        return prompt.count(IMAGE_PAD)

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        check_image_count(self.count_images(prompt), len(image_sizes), IMAGE_PAD)
        ids = self.tokenizer.encode(prompt)
        pads = [i for i, t in enumerate(ids) if t == self.image_token_id]
        check_image_count(len(pads), len(image_sizes), IMAGE_PAD)
        grids = [self.grid_thw(w, h) for w, h in image_sizes]
        counts = [self.grid.grid_tokens(grid) for grid in grids]
        token_ids: list[int] = []
        offsets: list[int] = []
        prev = 0
        for pad, count in zip(pads, counts, strict=True):
            token_ids += ids[prev:pad]
            offsets.append(len(token_ids))
            token_ids += [self.image_token_id] * count
            prev = pad + 1
        token_ids += ids[prev:]
        # The grids travel with the image references; the engine derives the M-RoPE positions from them.
        return MultimodalPrompt(token_ids=token_ids, offsets=offsets, num_tokens=counts, grid_thw=grids)
