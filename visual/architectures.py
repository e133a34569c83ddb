"""The HF `architectures[0]` names that have a vision tower here, as a list light enough to read before anything
heavy is imported: the server checks `--enable_multimodal` against it before it starts any process. Registering a
vision model under a name missing here fails at import (visual.models.base), so the two cannot drift apart."""

from __future__ import annotations

IMAGE_ARCHITECTURES = frozenset(
    {
        "QWenLMHeadModel",
        "LlavaForConditionalGeneration",
        "LlavaLlamaForCausalLM",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)
