"""Qwen3-VL prompts: Qwen2-VL's placeholders (`<|vision_start|><|image_pad|><|vision_end|>`), the same image processor
(with 16 px patches: 32 px per merged token) and token counts, so Qwen2-VL's processor as it is, reading the patch size
and pixel bounds from the checkpoint; a `<|video_pad|>` is refused (400) as for Qwen2-VL."""

from __future__ import annotations

from mmserve.multimodal.prompt import register_prompt_processor
from mmserve.multimodal.qwen2_vl import Qwen2VLPromptProcessor


@register_prompt_processor("Qwen3VLForConditionalGeneration")
class Qwen3VLPromptProcessor(Qwen2VLPromptProcessor):
    pass
