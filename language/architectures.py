"""The HF `architectures[0]` names the decoder families serve, as a list light enough to read before anything heavy
is imported: the server checks a checkpoint against it before it starts any process. Registering a decoder under a
name missing here fails at import (language.models.registry), so the two cannot drift apart."""

from __future__ import annotations

DECODER_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "QWenLMHeadModel",
        "LlavaForConditionalGeneration",
        "LlavaLlamaForCausalLM",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)


def check_listed(architectures: tuple[str, ...], listed: frozenset[str], where: str) -> None:
    """Raise if a family registers itself under a name that `listed` (the list in `where`) lacks."""
    missing = sorted(set(architectures) - listed)
    if missing:
        raise ValueError(f"architectures {missing} are registered but not listed in {where}: add them there")
