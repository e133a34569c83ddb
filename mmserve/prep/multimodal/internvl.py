"""InternVL prompts (the `-hf` layout): each `<IMG_CONTEXT>` the chat template writes is one image, in order, and
becomes `<img>` + its embedding positions + `</img>`, as InternVLProcessor expands it. An image's embedding count is
its tile count (the image processor's grid for its size, plus the thumbnail) times `image_seq_length`; the positions
carry `<IMG_CONTEXT>`'s id, as HF's, and are overwritten by the embeddings.

The prompt is tokenized whole and each `<IMG_CONTEXT>` token is replaced by the expansion: special tokens are never
merged with their neighbours, so this gives the ids of tokenizing InternVLProcessor's expanded text. `<video>` (the
chat template's video placeholder) is refused with a 400. The remote-code layout's `<image>` prompts: below."""

from __future__ import annotations

import os

from transformers import AutoProcessor, PreTrainedTokenizerBase

from mmserve.http.protocol import BadRequest
from mmserve.prep.multimodal.prompt import MultimodalPrompt, check_image_count
from visual.models import internvl_chat
from visual.models.weights import read_json


class InternVLPromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor) -> None:
        self.tokenizer = tokenizer
        self.processor = processor  # transformers' InternVLProcessor: token names and the tile arithmetic
        self.image_text = processor.image_token  # <IMG_CONTEXT>
        self.video_text = processor.video_token
        self.context_id = processor.image_token_id
        self.start_id, self.end_id = processor.start_image_token_id, processor.end_image_token_id

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> InternVLPromptProcessor:
        return cls(tokenizer, AutoProcessor.from_pretrained(model_dir))

    def count_images(self, prompt: str) -> int:
        if self.video_text and self.video_text in prompt:
            raise BadRequest("inputs", f"video input is not supported: the prompt has {self.video_text} (images only)")
        return prompt.count(self.image_text)

    def image_tokens(self, image_sizes: list[tuple[int, int]], max_patches: int | None = None) -> list[int]:
        """Embedding positions of each (width, height) image: InternVLProcessor's count less `<img>` and `</img>`
        (`max_patches`: the request's tile cap; None: the checkpoint's)."""
        sizes = [(height, width) for width, height in image_sizes]
        cap = {} if max_patches is None else {"max_patches": max_patches}
        return [n - 2 for n in self.processor._get_num_multimodal_tokens(image_sizes=sizes, **cap).num_image_tokens]

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        return self.encode_tiled(prompt, image_sizes, None)

    def encode_tiled(
        self, prompt: str, image_sizes: list[tuple[int, int]], max_patches: int | None
    ) -> MultimodalPrompt:
        """`encode` with the request's tile cap (LightLLM's `image_max_patch_num`; None: the checkpoint's)."""
        check_image_count(self.count_images(prompt), len(image_sizes), self.image_text)
        ids = self.tokenizer.encode(prompt)
        contexts = [i for i, t in enumerate(ids) if t == self.context_id]
        check_image_count(len(contexts), len(image_sizes), self.image_text)
        counts = self.image_tokens(image_sizes, max_patches) if image_sizes else []
        token_ids: list[int] = []
        offsets: list[int] = []
        prev = 0
        for at, count in zip(contexts, counts, strict=True):
            token_ids += ids[prev:at] + [self.start_id]
            offsets.append(len(token_ids))
            token_ids += [self.context_id] * count + [self.end_id]
            prev = at + 1
        token_ids += ids[prev:]
        return MultimodalPrompt(token_ids=token_ids, offsets=offsets, num_tokens=counts)


class InternVLChatPromptProcessor:
    """The remote-code layout (`InternVLChatModel`): each `<image>` in the prompt is one image, replaced by `<img>` +
    its `<IMG_CONTEXT>` positions + `</img>` as the remote code's `chat` does (a text replacement, then the whole
    query tokenized). The text between placeholders is tokenized piece by piece, which is the same: `<img>` and
    `</img>` are special tokens, never merged with their neighbours. Tiles are counted by the GotOcr2 processor
    built from config.json (visual/models/internvl_chat.py), as the visual process cuts them."""

    image_text = "<image>"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor, images_kwargs: dict, tokens_per_tile: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.images_kwargs = images_kwargs
        self.tokens_per_tile = tokens_per_tile
        ids = tokenizer.convert_tokens_to_ids(["<img>", "<IMG_CONTEXT>", "</img>"])
        if tokenizer.unk_token_id in ids or None in ids:
            raise ValueError("the tokenizer lacks InternVL's <img>, <IMG_CONTEXT> or </img> token")
        self.start_id, self.context_id, self.end_id = ids

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> InternVLChatPromptProcessor:
        raw = read_json(os.path.join(model_dir, "config.json"))
        config = internvl_chat.chat_config(raw)
        image_processor, images_kwargs = internvl_chat.chat_image_processor(raw, config)
        return cls(tokenizer, image_processor, images_kwargs, config.image_seq_length)

    def count_images(self, prompt: str) -> int:
        return prompt.count(self.image_text)

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        return self.encode_tiled(prompt, image_sizes, None)

    def encode_tiled(
        self, prompt: str, image_sizes: list[tuple[int, int]], max_patches: int | None
    ) -> MultimodalPrompt:
        """`encode` with the request's tile cap (LightLLM's `image_max_patch_num`; None: config.json's)."""
        check_image_count(self.count_images(prompt), len(image_sizes), self.image_text)
        kwargs = self.images_kwargs if max_patches is None else {**self.images_kwargs, "max_patches": max_patches}
        counts = [self.image_processor.get_number_of_image_patches(h, w, kwargs) * self.tokens_per_tile
                  for w, h in image_sizes]  # fmt: skip
        pieces = prompt.split(self.image_text)
        token_ids = self.tokenizer.encode(pieces[0])
        offsets: list[int] = []
        for piece, count in zip(pieces[1:], counts, strict=True):
            token_ids.append(self.start_id)
            offsets.append(len(token_ids))
            token_ids += [self.context_id] * count + [self.end_id]
            token_ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return MultimodalPrompt(token_ids=token_ids, offsets=offsets, num_tokens=counts)
