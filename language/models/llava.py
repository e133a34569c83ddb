"""LLaVA-1.5's language model: the Llama decoder under the names of both published layouts. The image embeddings
come from the visual process and are spliced in at the placeholder positions by the decoder's forward."""

from __future__ import annotations

from language.config import LMConfig
from language.models.hf_config import lm_config_from_hf
from language.models.llama import LlamaForCausalLM

_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.mm_projector.",
    "model.image_newline",
)


class LlavaHFForCausalLM(LlamaForCausalLM):
    """llava-hf layout: `language_model.model.*` + `language_model.lm_head` (before transformers 4.52) or
    `model.language_model.*` + `lm_head` (after)."""

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        if name in ("language_model.lm_head.weight", "lm_head.weight"):
            return "lm_head.weight"
        return None


class LlavaOriginalForCausalLM(LlamaForCausalLM):
    """liuhaotian layout: Llama fields at the top level of a `llava` config, Llama tensor names, the projector
    beside them as `model.mm_projector.*`, and the CLIP tower in its own folder."""

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        return lm_config_from_hf(model_dir, raw_config, qkv_bias=False, model_type="llama")

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        return super().checkpoint_name(name)
