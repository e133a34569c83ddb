"""Decoder families; importing this package registers each under its HF architecture names."""

from language.models import llama, llava, qwen, qwen2_5_vl, qwen2_vl, qwen3_vl  # noqa: F401
from language.models.registry import model_class, register_model

__all__ = ["model_class", "register_model"]
