"""Gemma 3's vision side: transformers' SigLIP vision model (no pooling head) and Gemma3MultiModalProjector (average
pooling of the patch grid to `mm_tokens_per_image`, the soft-embedding RMSNorm, the projection to the LLM's width),
with the checkpoint's weights as google publish them (`vision_tower.vision_model.*`, `multi_modal_projector.*`) or
as transformers 5 saves them (under `model.`).

Preprocessing is the checkpoint's Gemma3ImageProcessor: every image is resized to the tower's square and becomes
`mm_tokens_per_image` embeddings. Pan-and-scan (extra crops of wide images, each its own image block in the prompt)
is off in the published checkpoints; a checkpoint that turns it on is refused at start rather than served with fewer
crops than HF's processor cuts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoImageProcessor, Gemma3Config, SiglipVisionModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from visual.models.base import ImageInput
from visual.models.weights import load_module_state, load_prefixed_tensors

TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


@dataclass
class Gemma3Preprocessor:
    """Image -> pixel values [1, 3, S, S], as Gemma3Processor makes them. Holds no weights (the preprocessing pool
    ships it to its workers)."""

    image_processor: object  # transformers' Gemma3ImageProcessor
    tokens_per_image: int  # mm_tokens_per_image
    patches: int  # positions the tower runs over for one image

    def __call__(self, image: Image.Image) -> ImageInput:
        pixels = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
        return ImageInput(pixel_values=pixels, num_tokens=self.tokens_per_image, patches=self.patches)


def read_preprocessor(model_dir: str, config: Gemma3Config) -> Gemma3Preprocessor:
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    if getattr(image_processor, "do_pan_and_scan", False):
        raise ValueError(
            "this Gemma 3 checkpoint turns pan-and-scan on (preprocessor_config.json), which is not served"
        )
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return Gemma3Preprocessor(image_processor, config.mm_tokens_per_image, patches)


class Gemma3VisionModel:
    """The tower and projector of one checkpoint (the family's `VisionModel`)."""

    def __init__(self, config: Gemma3Config, tower: SiglipVisionModel, projector: Gemma3MultiModalProjector,
                 preprocessor: Gemma3Preprocessor, cache_salt: str):  # fmt: skip
        self.config = config
        self.tower = tower.eval()
        self.projector = projector.eval()
        self.cache_salt = cache_salt
        self.hidden_size: int = config.text_config.hidden_size
        self._preprocessor = preprocessor

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> Gemma3Preprocessor:
        return read_preprocessor(model_dir, Gemma3Config.from_pretrained(model_dir))

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype) -> Gemma3VisionModel:
        config = Gemma3Config.from_pretrained(model_dir)
        config.vision_config._attn_implementation = "sdpa"
        with torch.device(device):  # random init on the target device is fast; the weights overwrite it
            tower = SiglipVisionModel._from_config(config.vision_config, dtype=dtype)
            projector = Gemma3MultiModalProjector(config).to(dtype)
        load_module_state(tower, load_prefixed_tensors(model_dir, tower_prefixes(tower)), "Gemma 3 vision tower")
        load_module_state(projector, load_prefixed_tensors(model_dir, PROJECTOR_PREFIXES), "Gemma 3 projector")
        preprocessor = read_preprocessor(model_dir, config)
        salt = json.dumps(["gemma3", os.path.realpath(model_dir), preprocessor.image_processor.to_json_string(),
                           str(dtype)], sort_keys=True)  # fmt: skip
        return cls(config, tower, projector, preprocessor, salt)

    def preprocessor(self) -> Gemma3Preprocessor:
        return self._preprocessor

    def preprocess(self, image: Image.Image) -> ImageInput:
        return self._preprocessor(image)

    def num_tokens(self, width: int, height: int) -> int:
        return self._preprocessor.tokens_per_image

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """All images through the tower at once (they are all the tower's size) -> [tokens, hidden] each."""
        device, dtype = self.tower.device, self.tower.dtype
        pixels = torch.cat([im.pixel_values for im in images]).to(device=device, dtype=dtype)  # [B, 3, S, S]
        features = self.tower(pixel_values=pixels).last_hidden_state  # [B, patches, vision hidden]
        return list(self.projector(features).unbind(0))  # [tokens, hidden] each


def tower_prefixes(tower: SiglipVisionModel) -> tuple[str, ...]:
    """The checkpoint's prefixes that leave the tower's own names: transformers 5.24's SiglipVisionModel holds the
    transformer's modules itself, older ones under `vision_model.`."""
    if any(name.startswith("vision_model.") for name in tower.state_dict()):
        return TOWER_PREFIXES
    return tuple(prefix + "vision_model." for prefix in TOWER_PREFIXES)
