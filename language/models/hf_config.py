"""Normalising transformers' config classes (both the published and the transformers-5 dialect) into LMConfig."""

from __future__ import annotations

import json
import os

from transformers import AutoConfig

from language.config import LMConfig
from language.loader import architecture, checkpoint_dtype


def eos_token_ids(model_dir: str, raw: dict, text: object) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json together (either may hold a list)."""
    ids: list[int] = []
    sources = [raw.get("eos_token_id"), getattr(text, "eos_token_id", None)]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def rope_theta(text: object) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0)


# RoPE types served as plain RoPE: M-RoPE's sections are read below, and dynamic NTK changes the base only past
# max_position_embeddings, where the engine caps requests. Any other type (linear, yarn, llama3, longrope...) would
# be served with the wrong angles, so it is refused at start.
PLAIN_ROPE_TYPES = ("default", "mrope", "dynamic")


def check_rope_type(text: object, raw: dict) -> None:
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or raw.get("rope_scaling")
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in PLAIN_ROPE_TYPES:
        served = ", ".join(PLAIN_ROPE_TYPES)
        raise ValueError(f"{kind!r} RoPE scaling is not served for {architecture(raw)} ({served} are)")


def _mrope_parameters(text: object, raw: dict) -> dict:
    for src in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None), raw.get("rope_scaling")):
        if isinstance(src, dict) and src.get("mrope_section"):
            return src
    return {}


def mrope_section(text: object, raw: dict) -> tuple[int, ...] | None:
    section = _mrope_parameters(text, raw).get("mrope_section")
    return tuple(section) if section else None


def mrope_interleaved(text: object, raw: dict) -> bool:
    return bool(_mrope_parameters(text, raw).get("mrope_interleaved", False))


def lm_config_from_hf(
    model_dir: str,
    raw: dict,
    qkv_bias: bool,
    model_type: str | None = None,
    qk_norm: bool = False,
    plain_rope: bool = True,
) -> LMConfig:
    """The decoder's LMConfig from an HF config (for multimodal configs, its text part). `model_type` overrides the
    config's own where its fields follow another family's config class. plain_rope: the decoder applies plain RoPE
    (or M-RoPE), so any other RoPE type is refused; False where the family reads its own (Gemma 3)."""
    model_type = model_type or raw["model_type"]
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    text = hf.get_text_config()
    if plain_rope:
        check_rope_type(text, raw)
    raw_text = raw.get("text_config") or raw
    heads = text.num_attention_heads
    return LMConfig(
        architecture=architecture(raw),
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=rope_theta(text),
        max_position=text.max_position_embeddings,
        eos_token_ids=eos_token_ids(model_dir, raw, text),
        torch_dtype=checkpoint_dtype(raw),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw_text.get("tie_word_embeddings", False))),
        mrope_section=mrope_section(text, raw),
        mrope_interleaved=mrope_interleaved(text, raw),
        qk_norm=qk_norm,
    )
