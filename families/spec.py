"""What a model family is made of: its parts, named as lazy "module:attr" references so that the table imports
nothing heavy and `language/` and `visual/` never import `mmserve/` (each process resolves only the parts it runs),
and the optional capabilities it declares (read by the code that uses them, never probed with `hasattr`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


def resolve(ref: str) -> Any:
    """A "package.module:Name.attr" reference -> that object (importing the module)."""
    module_name, _, path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in path.split("."):
        obj = getattr(obj, attr)
    return obj


@dataclass(frozen=True)
class FamilySpec:
    name: str
    architectures: tuple[str, ...]  # the HF `architectures[0]` names it serves
    decoder: str  # the decoder class (`language.models.registry.CausalLM`)
    config_reader: str  # (model_dir, raw config.json) -> LMConfig
    test_checkpoint: str | None  # builds a tiny random checkpoint of the family: (out_dir, ...) -> model dir
    vision: str | None = None  # the vision tower + projector (`visual.models.base.VisionModel`); None: text only
    prompt: str | None = None  # the prompt processor (`mmserve.prep.multimodal.prompt.PromptProcessor`), with `vision`
    chat_template: str | None = None  # the published template, for a checkpoint folder without one
    # Optional capabilities:
    checks_image_size: bool = False  # prompt processor's `check_image_size(w, h)`: a refused size is a 400
    images_in_prompt: bool = False  # prompt processor's `image_items`: images named inside the prompt (Qwen-VL)
    videos: bool = False  # video input: the prompt processor's video methods and the vision preprocessor's `video`
    dummy_vision_weights: bool = False  # vision's `from_pretrained(..., dummy=True)`: --load_format dummy
    # prompt processor's `encode_tiled` and the preprocessor's `max_patches`: LightLLM's `image_max_patch_num`
    tiles_images: bool = False

    def part(self, name: str) -> Any:
        """The resolved part ("decoder", "vision", ...); ValueError if the family has none."""
        ref = getattr(self, name)
        if ref is None:
            raise ValueError(f"the {self.name} family has no {name}")
        return resolve(ref)
