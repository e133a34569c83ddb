"""LLaVA-1.5 prompts: each `<image>` is one image, in order, and becomes its 576 (tiny checkpoints: fewer)
embedding positions.

- llava-hf: `<image>` is a special token of the tokenizer (32000 = `image_token_index`); the prompt is tokenized as
  a whole and each image token is repeated to the image's token count (what LlavaProcessor does).
- original layout: the tokenizer has no `<image>`; as LLaVA's `tokenizer_image_token` does, the text is split at
  `<image>`, each piece tokenized on its own (BOS kept only on the first), and the image positions inserted between.
  Their ids are a placeholder the LM embeds and then overwrites with the image embeddings.
"""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase

from mmserve.multimodal.prompt import MultimodalPrompt, check_image_count, register_prompt_processor
from visual.models.llava import LlavaVisionSpec
from visual.models.weights import read_json

IMAGE_TEXT = "<image>"


@register_prompt_processor("LlavaForConditionalGeneration", "LlavaLlamaForCausalLM")
class LlavaPromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, num_tokens: int, image_token_id: int | None,
                 placeholder_id: int):  # fmt: skip
        self.tokenizer = tokenizer
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
            return cls(tokenizer, spec.num_tokens, None, placeholder)
        image_id = spec.config.image_token_id
        if tokenizer.convert_tokens_to_ids(IMAGE_TEXT) != image_id:
            raise ValueError(f"the tokenizer's {IMAGE_TEXT} is not image_token_index {image_id} of config.json")
        return cls(tokenizer, spec.num_tokens, image_id, image_id)

    def count_images(self, prompt: str) -> int:
        return prompt.count(IMAGE_TEXT)

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
