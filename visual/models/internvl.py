"""InternVL's vision side: transformers' InternViT tower (InternVLVisionModel), the 2x2 pixel shuffle and the
LayerNorm-Linear-GELU-Linear projector (InternVLMultiModalProjector), with the checkpoint's weights: in the
transformers-native layout (`InternVLForConditionalGeneration`: `model.vision_tower.*` / `vision_tower.*`,
`model.multi_modal_projector.*` / `multi_modal_projector.*`) or the remote-code one (`InternVLChatModel`:
`vision_model.*`, `mlp1.*`, read as the native one by visual/models/internvl_chat.py).

Preprocessing is the checkpoint's GotOcr2 image processor with the images kwargs InternVLProcessor gives it
(`crop_to_patches`): an image becomes up to `max_patches` tiles of the tower's size in the grid closest to its aspect
ratio, plus a thumbnail of the whole image when there are several; every tile is `image_seq_length` embeddings.
All tiles of a batch of images go through the tower together (they are all the same size).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from PIL import Image
from transformers import AutoProcessor, InternVLConfig
from transformers.models.internvl import modeling_internvl as hf

from visual.models import internvl_chat
from visual.models.base import ImageInput
from visual.models.weights import load_module_state, load_prefixed_tensors, read_json

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


@dataclass
class InternVLPreprocessor:
    """Image -> its tiles' pixel values [tiles, 3, T, T], as InternVLProcessor makes them. Holds no weights (the
    preprocessing pool ships it to its workers)."""

    image_processor: object  # transformers GotOcr2ImageProcessor
    images_kwargs: dict  # what InternVLProcessor passes it (crop_to_patches)
    tokens_per_tile: int  # image_seq_length
    positions_per_tile: int  # what the tower runs over for one tile: its patches and the CLS token

    def __call__(self, image: Image.Image, max_patches: int | None = None) -> ImageInput:
        """`max_patches`: this request's tile cap (LightLLM's `image_max_patch_num`); None: the checkpoint's."""
        kwargs = self.kwargs(max_patches)
        out = self.image_processor(images=[image.convert("RGB")], **kwargs, return_tensors="pt")
        pixels = out["pixel_values"]  # [tiles, 3, T, T]
        tiles = pixels.shape[0]
        return ImageInput(pixel_values=pixels, num_tokens=tiles * self.tokens_per_tile,
                          patches=tiles * self.positions_per_tile)  # fmt: skip

    def num_tiles(self, width: int, height: int, max_patches: int | None = None) -> int:
        return self.image_processor.get_number_of_image_patches(height, width, self.kwargs(max_patches))

    def kwargs(self, max_patches: int | None) -> dict:
        return self.images_kwargs if max_patches is None else {**self.images_kwargs, "max_patches": max_patches}


def read_config(model_dir: str) -> InternVLConfig:
    raw = read_json(os.path.join(model_dir, "config.json"))
    return (
        internvl_chat.chat_config(raw)
        if internvl_chat.is_chat_layout(raw)
        else InternVLConfig.from_pretrained(model_dir)
    )


# The oldest transformers whose InternVL processor this family is tested against (5.17 tiles differently, and its
# _merge_kwargs takes other arguments): an older one is refused at start rather than served with other tiles than HF's.
MIN_TRANSFORMERS = "5.24"


def check_transformers() -> None:
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(f"InternVL needs transformers >= {MIN_TRANSFORMERS} (found {transformers.__version__})")


def read_preprocessor(model_dir: str, config: InternVLConfig) -> InternVLPreprocessor:
    """The -hf layout's InternVLProcessor (its image processor and the images kwargs it passes), or the remote-code
    layout's equivalent built from config.json."""
    check_transformers()
    vision = config.vision_config
    positions = (vision.image_size[0] // vision.patch_size[0]) * (vision.image_size[1] // vision.patch_size[1]) + 1
    raw = read_json(os.path.join(model_dir, "config.json"))
    if internvl_chat.is_chat_layout(raw):
        image_processor, images_kwargs = internvl_chat.chat_image_processor(raw, config)
        return InternVLPreprocessor(image_processor, images_kwargs, config.image_seq_length, positions)
    processor = AutoProcessor.from_pretrained(model_dir)
    images_kwargs = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)["images_kwargs"]
    return InternVLPreprocessor(processor.image_processor, images_kwargs, processor.image_seq_length, positions)


def read_vision_state(model_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the tower's state, the projector's) under transformers' names, from either layout."""
    if internvl_chat.is_chat_layout(read_json(os.path.join(model_dir, "config.json"))):
        tower = load_prefixed_tensors(model_dir, (internvl_chat.TOWER_PREFIX,))
        projector = load_prefixed_tensors(model_dir, (internvl_chat.PROJECTOR_PREFIX,))
        return internvl_chat.tower_state(tower), internvl_chat.projector_state(projector)
    return load_prefixed_tensors(model_dir, TOWER_PREFIXES), load_prefixed_tensors(model_dir, PROJECTOR_PREFIXES)


class InternVLVisionModel:
    """The tower, pixel shuffle and projector of one checkpoint (the family's `VisionModel`)."""

    def __init__(self, config: InternVLConfig, tower: hf.InternVLVisionModel, projector: hf.InternVLMultiModalProjector,
                 preprocessor: InternVLPreprocessor, cache_salt: str):  # fmt: skip
        self.config = config
        self.tower = tower.eval()
        self.projector = projector.eval()
        self.cache_salt = cache_salt
        self.hidden_size: int = config.text_config.hidden_size
        self._preprocessor = preprocessor

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> InternVLPreprocessor:
        return read_preprocessor(model_dir, read_config(model_dir))

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype) -> InternVLVisionModel:
        config = read_config(model_dir)
        config.vision_config._attn_implementation = "sdpa"
        with torch.device(device):  # random init on the target device is fast; the weights overwrite it
            tower = hf.InternVLVisionModel._from_config(config.vision_config, dtype=dtype)
            projector = hf.InternVLMultiModalProjector(config).to(dtype)
        tower_state, projector_state = read_vision_state(model_dir)
        load_module_state(tower, tower_state, "InternVL vision tower")
        load_module_state(projector, projector_state, "InternVL projector")
        preprocessor = read_preprocessor(model_dir, config)
        salt = json.dumps(["internvl", os.path.realpath(model_dir), preprocessor.image_processor.to_json_string(),
                           preprocessor.images_kwargs, str(dtype)], sort_keys=True, default=str)  # fmt: skip
        return cls(config, tower, projector, preprocessor, salt)

    def preprocessor(self) -> InternVLPreprocessor:
        return self._preprocessor

    def preprocess(self, image: Image.Image, max_patches: int | None = None) -> ImageInput:
        return self._preprocessor(image, max_patches)

    def num_tokens(self, width: int, height: int) -> int:
        return self._preprocessor.num_tiles(width, height) * self._preprocessor.tokens_per_tile

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device, dtype = self.tower.device, self.tower.dtype
        tiles = torch.cat([im.pixel_values for im in images]).to(device=device, dtype=dtype)  # [sum tiles, 3, T, T]
        embeds = self.project(self.features(tiles))  # [sum tiles, tokens per tile, hidden]
        counts = [im.pixel_values.shape[0] for im in images]
        return [e.reshape(-1, self.hidden_size) for e in embeds.split(counts)]

    def features(self, tiles: torch.Tensor) -> torch.Tensor:
        """The tower's features of `vision_feature_layer` for each tile's patches [tiles, patches, vision hidden]
        (the CLS position dropped under the "default" strategy)."""
        layer = self.config.vision_feature_layer
        out = self.tower(pixel_values=tiles, output_hidden_states=layer != -1)
        features = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        return features[:, 1:] if self.config.vision_feature_select_strategy == "default" else features

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """[tiles, side * side, C] -> pixel shuffle [tiles, (side / 2)^2, 4C] -> projector [tiles, tokens, hidden]."""
        tiles, patches, channels = features.shape
        side = int(patches**0.5)
        grid = features.reshape(tiles, side, side, channels)
        # transformers' own pixel shuffle (a function of its arguments only: the model instance is not used)
        shuffled = hf.InternVLModel.pixel_shuffle(None, grid, scale_factor=self.config.downsample_ratio)
        return self.projector(shuffled.reshape(tiles, -1, shuffled.shape[-1]))
