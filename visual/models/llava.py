"""LLaVA-1.5's vision side: the CLIP tower (transformers' CLIPVisionModel), the feature layer `vision_feature_layer`
with the CLS feature dropped, and the Linear-GELU-Linear projector (transformers' LlavaMultiModalProjector).

Both published layouts load:
- llava-hf: everything in the model folder (tensors `vision_tower.vision_model.*` + `multi_modal_projector.*`, or
  with a `model.` prefix since transformers 4.52); preprocessing by the folder's CLIPImageProcessor.
- original (liuhaotian): the projector `model.mm_projector.{0,2}` in the folder, the tower in the CLIP folder that
  `mm_vision_tower` names (a local path; `vision_tower_dir` overrides it); the image is first padded to a square on
  the processor's mean colour, then preprocessed by the CLIP folder's processor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoImageProcessor, CLIPVisionConfig, CLIPVisionModel, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from visual.models.base import ImageInput
from visual.models.weights import load_prefixed_tensors, read_json

HF_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.")
HF_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
ORIGINAL_PROJECTOR_PREFIXES = ("model.mm_projector.",)
ORIGINAL_PROJECTOR_NAMES = {"0.weight": "linear_1.weight", "0.bias": "linear_1.bias",
                            "2.weight": "linear_2.weight", "2.bias": "linear_2.bias"}  # fmt: skip


def expand_to_square(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """The original LLaVA's `expand2square`: centre the image on a square of the background colour."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), background)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


@dataclass
class LlavaPreprocessor:
    """Image -> pixel values, exactly as the checkpoint's processor does it. Holds no weights, so the preprocessing
    pool can ship it to its worker processes."""

    image_processor: object  # transformers CLIPImageProcessor
    pad_to_square: bool
    num_tokens: int

    def __call__(self, image: Image.Image) -> ImageInput:
        image = image.convert("RGB")
        if self.pad_to_square:
            mean = self.image_processor.image_mean
            image = expand_to_square(image, tuple(int(x * 255) for x in mean))
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]  # [3, H, W]
        return ImageInput(pixel_values=pixels, num_tokens=self.num_tokens)


@dataclass(frozen=True)
class LlavaVisionSpec:
    """Where a checkpoint's vision parts are and how they are configured, read from its config files only."""

    config: LlavaConfig  # vision_config, projector, feature layer and strategy, text hidden size
    tower_dir: str  # folder with the tower's tensors (the model folder for llava-hf)
    tower_prefixes: tuple[str, ...]
    projector_prefixes: tuple[str, ...]
    processor_dir: str
    pad_to_square: bool

    @classmethod
    def read(cls, model_dir: str, vision_tower_dir: str | None = None) -> LlavaVisionSpec:
        raw = read_json(os.path.join(model_dir, "config.json"))
        if raw.get("architectures", [""])[0] != "LlavaLlamaForCausalLM":
            return cls(LlavaConfig.from_pretrained(model_dir), model_dir, HF_TOWER_PREFIXES, HF_PROJECTOR_PREFIXES,
                       model_dir, pad_to_square=False)  # fmt: skip
        tower_dir = resolve_tower_dir(model_dir, vision_tower_dir or raw.get("mm_vision_tower"))
        if raw.get("mm_projector_type", "mlp2x_gelu") != "mlp2x_gelu":
            raise ValueError(f"unsupported mm_projector_type {raw['mm_projector_type']!r} (LLaVA-1.5 uses mlp2x_gelu)")
        config = LlavaConfig(
            vision_config=CLIPVisionConfig.from_pretrained(tower_dir).to_dict(),  # a CLIPModel folder works too
            text_config={"model_type": "llama", "hidden_size": raw["hidden_size"], "vocab_size": raw["vocab_size"]},
            projector_hidden_act="gelu",
            vision_feature_layer=raw.get("mm_vision_select_layer", -2),
            # "patch" drops the CLS feature ("default" in llava-hf terms); "cls_patch" keeps it ("full").
            vision_feature_select_strategy="default" if raw.get("mm_vision_select_feature") != "cls_patch" else "full",
        )  # fmt: skip
        pad = raw.get("image_aspect_ratio", "square") == "pad"
        return cls(config, tower_dir, ("vision_model.",), ORIGINAL_PROJECTOR_PREFIXES, tower_dir, pad_to_square=pad)

    @property
    def num_tokens(self) -> int:
        vision = self.config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (1 if self.config.vision_feature_select_strategy == "full" else 0)


def resolve_tower_dir(model_dir: str, tower: str | None) -> str:
    """mm_vision_tower as a local folder: as given, or relative to the model folder. Hub names cannot be fetched."""
    if not tower:
        raise ValueError("the original LLaVA layout needs mm_vision_tower (or --vision_tower_dir): the CLIP folder")
    for candidate in (tower, os.path.join(model_dir, tower)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return os.path.abspath(candidate)
    raise ValueError(
        f"mm_vision_tower {tower!r} is not a local folder with a config.json; download the CLIP checkpoint and "
        f"point --vision_tower_dir (or mm_vision_tower in {model_dir}/config.json) at it"
    )


class LlavaVisionModel:
    def __init__(self, spec: LlavaVisionSpec, tower: CLIPVisionModel, projector: LlavaMultiModalProjector,
                 image_processor: object, cache_salt: str):  # fmt: skip
        self.spec = spec
        self.tower = tower.eval()
        self.projector = projector.eval()
        self.cache_salt = cache_salt
        self.hidden_size: int = spec.config.text_config.hidden_size
        self._preprocessor = LlavaPreprocessor(image_processor, spec.pad_to_square, spec.num_tokens)

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> LlavaPreprocessor:
        """The preprocessor from the config files alone (the pool starts it while the tower loads)."""
        spec = LlavaVisionSpec.read(model_dir, vision_tower_dir)
        image_processor = AutoImageProcessor.from_pretrained(spec.processor_dir)
        return LlavaPreprocessor(image_processor, spec.pad_to_square, spec.num_tokens)

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype,
                        vision_tower_dir: str | None = None) -> LlavaVisionModel:  # fmt: skip
        spec = LlavaVisionSpec.read(model_dir, vision_tower_dir)
        with torch.device(device):  # random init on the target device is fast; the weights overwrite it
            tower = CLIPVisionModel._from_config(spec.config.vision_config, dtype=dtype)
            projector = LlavaMultiModalProjector(spec.config).to(dtype)
        _load(tower, _tower_state(tower, load_prefixed_tensors(spec.tower_dir, spec.tower_prefixes)), "vision tower")
        projector_state = load_prefixed_tensors(model_dir, spec.projector_prefixes)
        if spec.projector_prefixes == ORIGINAL_PROJECTOR_PREFIXES:
            projector_state = {ORIGINAL_PROJECTOR_NAMES.get(k, k): v for k, v in projector_state.items()}
        _load(projector, projector_state, "projector")
        image_processor = AutoImageProcessor.from_pretrained(spec.processor_dir)
        salt = json.dumps(["llava", os.path.realpath(model_dir), os.path.realpath(spec.tower_dir),
                           image_processor.to_json_string(), spec.pad_to_square, str(dtype)])  # fmt: skip
        return cls(spec, tower, projector, image_processor, salt)

    def preprocessor(self) -> LlavaPreprocessor:
        return self._preprocessor

    def preprocess(self, image: Image.Image) -> ImageInput:
        return self._preprocessor(image)

    def num_tokens(self, width: int, height: int) -> int:
        return self.spec.num_tokens  # every image is resized to the tower's square input

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device, dtype = self.tower.device, self.tower.dtype
        pixels = torch.stack([im.pixel_values for im in images]).to(device=device, dtype=dtype)  # [B, 3, H, W]
        out = self.tower(pixels, output_hidden_states=True)
        features = out.hidden_states[self.spec.config.vision_feature_layer]  # [B, 1 + patches, vision_hidden]
        if self.spec.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        embeds = self.projector(features)  # [B, num_tokens, hidden]
        return list(embeds.unbind(0))


def _tower_state(tower: CLIPVisionModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names are relative to `vision_model.`; some transformers versions nest the module under it."""
    nested = any(k.startswith("vision_model.") for k in tower.state_dict())
    return {("vision_model." + k if nested else k): v for k, v in tensors.items()}


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    if not state:
        raise ValueError(f"no {what} tensors found in the checkpoint")
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]  # a buffer, stored by older checkpoints only
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"LLaVA {what} weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
