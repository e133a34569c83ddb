"""Qwen2.5-VL prompts: Qwen2-VL's placeholders (`<|vision_start|><|image_pad|><|vision_end|>`), image processor and
token counts, so Qwen2-VL's processor as it is; a `<|video_pad|>` is refused (400) as for Qwen2-VL."""

from __future__ import annotations

from mmserve.multimodal.prompt import register_prompt_processor
from mmserve.multimodal.qwen2_vl import Qwen2VLPromptProcessor


@register_prompt_processor("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLPromptProcessor(Qwen2VLPromptProcessor):
    pass
