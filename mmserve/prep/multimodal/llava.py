"""LLaVA-1.5 prompts: each `<image>` is one image, in order, and becomes its 576 (tiny checkpoints: fewer)
embedding positions.

- llava-hf: `<image>` is a special token of the tokenizer (32000 = `image_token_index`); the prompt is tokenized as
  a whole and each image token is repeated to the image's token count (what LlavaProcessor does).
- original layout: the tokenizer has no `<image>`; as LLaVA's `tokenizer_image_token` does, the text is split at
  `<image>`, each piece tokenized on its own (BOS kept only on the first), and the image positions inserted between.
  Their ids are a placeholder the LM embeds and then overwrites with the image embeddings.

Every image becomes the same token count, but not at the same cost: the CLIP processor scales the short side to the
tower's size before it crops, so a 1x4000 image is resized to 336x1344000 pixels first (4 GB and ~10 s of a
preprocessing worker), and the original layout first pads the image to a square of its long side. `check_image_size`
bounds both from the header: the aspect ratio to Qwen2-VL's 200:1, and the padded square to what the visual process
decodes at most.
"""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase

from mmserve.prep.multimodal.image_io import BadImage
from mmserve.prep.multimodal.prompt import (
    MAX_ASPECT_RATIO,
    MultimodalPrompt,
    check_aspect_ratio,
    check_image_count,
)
from visual.models.llava import LlavaVisionSpec
from visual.models.weights import read_json
from visual.preprocess import MAX_PIXELS as MAX_DECODED_PIXELS

IMAGE_TEXT = "<image>"


class LlavaPromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, num_tokens: int, image_token_id: int | None,
                 placeholder_id: int, pad_to_square: bool = False):  # fmt: skip
        self.tokenizer = tokenizer
        self.pad_to_square = pad_to_square  # the original layout's image_aspect_ratio "pad"
        self.num_tokens_per_image = num_tokens
        self.image_token_id = image_token_id  # llava-hf: the tokenizer's <image>; None: original layout
        self.placeholder_id = placeholder_id  # the id written at image positions

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase,
                        vision_tower_dir: str | None = None) -> LlavaPromptProcessor:  # fmt: skip
        spec = LlavaVisionSpec.read(model_dir, vision_tower_dir)
        raw = read_json(os.path.join(model_dir, "config.json"))
        if raw["architectures"][0] == "LlavaLlamaForCausalLM":
            # Any id inside the vocabulary works (its embedding row is overwritten); <unk> never comes out of text.
            placeholder = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else 0
            return cls(tokenizer, spec.num_tokens, None, placeholder, spec.pad_to_square)
        image_id = spec.config.image_token_id
        if tokenizer.convert_tokens_to_ids(IMAGE_TEXT) != image_id:
            raise ValueError(f"the tokenizer's {IMAGE_TEXT} is not image_token_index {image_id} of config.json")
        return cls(tokenizer, spec.num_tokens, image_id, image_id)

    def count_images(self, prompt: str) -> int:
        return prompt.count(IMAGE_TEXT)

    def check_image_size(self, width: int, height: int) -> None:
        check_aspect_ratio(width, height, MAX_ASPECT_RATIO, "the most this server resizes for LLaVA")
        side = max(width, height)
        if self.pad_to_square and side * side > MAX_DECODED_PIXELS:
            raise BadImage(
                f"image is {width}x{height}: padded to a square, as this model's processor does, it would "
                f"be {side}x{side} = {side * side} pixels, more than the limit of {MAX_DECODED_PIXELS}"
            )

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        check_image_count(self.count_images(prompt), len(image_sizes), IMAGE_TEXT)
        pieces = self._hf_pieces(prompt) if self.image_token_id is not None else self._original_pieces(prompt)
        ids: list[int] = []
        offsets: list[int] = []
        for i, piece in enumerate(pieces):
            if i > 0:  # an image between pieces i-1 and i
                offsets.append(len(ids))
                ids += [self.placeholder_id] * self.num_tokens_per_image
            ids += piece
        return MultimodalPrompt(ids, offsets, [self.num_tokens_per_image] * len(offsets))

    def _hf_pieces(self, prompt: str) -> list[list[int]]:
        ids = self.tokenizer(prompt).input_ids
        pieces: list[list[int]] = [[]]
        for token in ids:
            if token == self.image_token_id:
                pieces.append([])
            else:
                pieces[-1].append(token)
        check_image_count(len(pieces) - 1, self.count_images(prompt), IMAGE_TEXT)  # <image> must be one token
        return pieces

    def _original_pieces(self, prompt: str) -> list[list[int]]:
        chunks = [self.tokenizer(chunk).input_ids for chunk in prompt.split(IMAGE_TEXT)]
        bos = self.tokenizer.bos_token_id
        if chunks[0] and chunks[0][0] == bos:
            return [chunks[0]] + [chunk[1:] for chunk in chunks[1:]]  # each later chunk drops its own BOS
        return chunks
