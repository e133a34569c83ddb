"""InternVL's language model: the Qwen2 decoder (InternVL3) or a Llama one (InternVL2.5's converted InternLM2), in the
transformers-native layout (`InternVLForConditionalGeneration`, the `-hf` repositories: `text_config`, tensors
`model.language_model.*` + `lm_head` since transformers 4.52, `language_model.model.*` + `language_model.lm_head`
before) or the remote-code one (`InternVLChatModel`: `llm_config`, tensors `language_model.model.*` +
`language_model.lm_head`). The image embeddings are spliced in at the `<IMG_CONTEXT>` positions by the decoder's
forward."""

from __future__ import annotations

from language.config import LMConfig
from language.models.hf_config import lm_config_from_hf
from language.models.llama import LlamaForCausalLM

_LM_PREFIXES = ("model.language_model.", "language_model.model.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


class InternVLForCausalLM(LlamaForCausalLM):
    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        text_type = (raw_config.get("text_config") or {}).get("model_type", "qwen2")
        return lm_config_from_hf(model_dir, raw_config, qkv_bias=text_type == "qwen2")

    def checkpoint_name(self, name: str) -> str | None:
        """The decoder's tensors by our names; the tower and projector (`*vision_tower.*`,
        `*multi_modal_projector.*`) are the visual process's: None."""
        for prefix in _LM_PREFIXES:
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        return "lm_head.weight" if name in _LM_HEADS else None


class InternVLChatForCausalLM(InternVLForCausalLM):
    """The remote-code layout: the decoder's fields in `llm_config` (InternLM2's packed `wqkv`, InternVL2.5-8B, is not
    served)."""

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        llm = raw_config["llm_config"]
        text_type = llm.get("model_type")
        if text_type not in ("qwen2", "llama"):
            raise ValueError(f"InternVL with a {text_type!r} language model is not served (Qwen2 and Llama are)")
        # the top level names the architecture and dtype; the decoder's own fields are llm_config's
        raw = {**llm, "architectures": raw_config["architectures"], "torch_dtype": raw_config.get("torch_dtype")}
        return lm_config_from_hf(model_dir, raw, qkv_bias=text_type == "qwen2", model_type=text_type)
