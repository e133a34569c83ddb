"""Qwen-VL (v1) prompts: every `<img>...</img>` span becomes `<img>` + 256 `<imgpad>` + `</img>` (the embeddings go on
the pads). What is inside the tags says where the image comes from: nothing (the next of
`multimodal_params.images`, in order, as LightLLM's clients send), an http(s) URL, or a file path that must lie in the
directory the server allows (`--image_dir`)."""

from __future__ import annotations

import base64
import json
import os
import re

from mmserve.prep.multimodal.image_io import BadImage
from mmserve.prep.multimodal.prompt import MultimodalPrompt, check_image_count

IMAGE_SPAN = re.compile(r"<img>(.*?)</img>", re.DOTALL)
NUM_IMAGE_TOKENS = 256  # the resampler's query count


def read_allowed_path(path: str, image_dir: str | None, max_bytes: int) -> bytes:
    """The bytes of an image file named in a prompt; only a regular file inside image_dir (after resolving links)."""
    if image_dir is None:
        raise BadImage(f"image paths in prompts are not allowed on this server ({path!r}); send the image instead")
    root = os.path.realpath(image_dir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root or not os.path.isfile(full):
        raise BadImage(f"image path {path!r} is not a file in the allowed image directory")
    if os.path.getsize(full) > max_bytes:
        raise BadImage(f"image file {path!r} is larger than {max_bytes} bytes")
    with open(full, "rb") as f:
        return f.read()


def prompt_image_items(prompt: str, sent: list, image_dir: str | None = None, max_bytes: int = 32 << 20) -> list[dict]:
    """The images of a prompt in span order, as `multimodal_params.images` items ({"type", "data"}) that
    image_io.load_image accepts: empty tags take the sent items in order (their counts must agree), URLs are passed
    on to be fetched, allowed paths are read here. Raises PromptImageMismatch or BadImage (both answered 400)."""
    sources = [s.strip() for s in IMAGE_SPAN.findall(prompt)]
    check_image_count(sum(1 for s in sources if not s), len(sent), "empty <img></img>")
    sent_iter = iter(sent)
    items: list[dict] = []
    for source in sources:
        if not source:
            items.append(next(sent_iter))
        elif source.startswith(("http://", "https://")):
            items.append({"type": "url", "data": source})
        elif "://" in source:
            raise BadImage(f"unsupported image location {source!r} (http(s) URLs or allowed paths only)")
        else:
            data = read_allowed_path(source, image_dir, max_bytes)
            items.append({"type": "base64", "data": base64.b64encode(data).decode("ascii")})
    return items


class QwenVLPromptProcessor:
    def __init__(self, tokenizer, image_start_id: int, image_dir: str | None = None, max_image_bytes: int = 32 << 20):
        self.tokenizer = tokenizer
        self.image_dir = image_dir  # the server's --image_dir: where paths inside <img></img> may point
        self.max_image_bytes = max_image_bytes
        # The published layout: <img>, </img>, <imgpad> are consecutive ids (151857..151859).
        self.img_start_id, self.img_end_id, self.img_pad_id = image_start_id, image_start_id + 1, image_start_id + 2

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer) -> QwenVLPromptProcessor:
        with open(os.path.join(model_dir, "config.json")) as f:
            image_start_id = json.load(f)["visual"]["image_start_id"]
        if tokenizer.convert_tokens_to_ids("<img>") != image_start_id:
            raise ValueError(f"tokenizer's <img> id differs from the config's image_start_id {image_start_id}")
        return cls(tokenizer, image_start_id)

    def image_items(self, prompt: str, sent: list) -> list[dict]:
        """The request's images in span order (see prompt_image_items); the server calls this before loading them,
        so that URLs and allowed paths inside the tags count as images too."""
        return prompt_image_items(prompt, sent, self.image_dir, self.max_image_bytes)

    def count_images(self, prompt: str) -> int:
        return len(IMAGE_SPAN.findall(prompt))

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        """image_sizes: one per `<img>...</img>` span in order (every image is 256 tokens whatever its size)."""
        pieces = IMAGE_SPAN.split(prompt)  # text, source, text, source, ..., text
        check_image_count(len(pieces) // 2, len(image_sizes), "<img>...</img>")
        token_ids: list[int] = []
        offsets: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                token_ids += self.tokenizer.encode(piece, add_special_tokens=False) if piece else []
                continue
            token_ids.append(self.img_start_id)
            offsets.append(len(token_ids))
            token_ids += [self.img_pad_id] * NUM_IMAGE_TOKENS + [self.img_end_id]
        return MultimodalPrompt(token_ids=token_ids, offsets=offsets, num_tokens=[NUM_IMAGE_TOKENS] * len(offsets))
