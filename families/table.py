"""THE list of model families: HF `architectures[0]` -> its `FamilySpec`. The engine, router, visual process and HTTP
server look a family's parts up here and never branch on the model type. Adding a family is its own files and one
entry below (docs/adding_a_model_family.md)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from families.spec import FamilySpec

_QWEN2_VL_PROMPT = "mmserve.prep.multimodal.qwen2_vl:Qwen2VLPromptProcessor"  # also Qwen2.5-VL's and Qwen3-VL's


def _decoder(module: str, cls: str) -> dict:
    return dict(decoder=f"language.models.{module}:{cls}", config_reader=f"language.models.{module}:{cls}.lm_config")


FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("llama", ("LlamaForCausalLM", "MistralForCausalLM"), **_decoder("llama", "LlamaForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.llama:build_llama"),
    FamilySpec("qwen2", ("Qwen2ForCausalLM",), **_decoder("llama", "Qwen2ForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.llama:build_qwen2"),
    FamilySpec("qwen_vl", ("QWenLMHeadModel",), **_decoder("qwen", "QWenForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.qwen_vl:build_qwen_vl",
               vision="visual.models.qwen_vl:QwenVLVisionModel",
               prompt="mmserve.prep.multimodal.qwen_vl:QwenVLPromptProcessor",
               chat_template="mmserve.prep.chat_templates:QWEN_VL_CHAT", images_in_prompt=True),
    FamilySpec("llava_hf", ("LlavaForConditionalGeneration",), **_decoder("llava", "LlavaHFForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.llava:build_llava_hf",
               vision="visual.models.llava:LlavaVisionModel",
               prompt="mmserve.prep.multimodal.llava:LlavaPromptProcessor",
               chat_template="mmserve.prep.chat_templates:LLAVA_1_5", checks_image_size=True),
    FamilySpec("llava_original", ("LlavaLlamaForCausalLM",), **_decoder("llava", "LlavaOriginalForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.llava:build_llava_original",
               vision="visual.models.llava:LlavaVisionModel",
               prompt="mmserve.prep.multimodal.llava:LlavaPromptProcessor",
               chat_template="mmserve.prep.chat_templates:LLAVA_1_5", checks_image_size=True),
    FamilySpec("qwen2_vl", ("Qwen2VLForConditionalGeneration",), **_decoder("qwen2_vl", "Qwen2VLForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.qwen2_vl:build_qwen2_vl",
               vision="visual.models.qwen2_vl:Qwen2VLVisionModel", prompt=_QWEN2_VL_PROMPT,
               chat_template="mmserve.prep.chat_templates:QWEN2_VL", checks_image_size=True, dummy_vision_weights=True,
               videos=True),
    FamilySpec("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), **_decoder("qwen2_5_vl", "Qwen2_5_VLForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.qwen2_5_vl:build_qwen2_5_vl",
               vision="visual.models.qwen2_5_vl:Qwen2_5_VLVisionModel", prompt=_QWEN2_VL_PROMPT,
               chat_template="mmserve.prep.chat_templates:QWEN2_VL", checks_image_size=True, dummy_vision_weights=True,
               videos=True),
    FamilySpec("qwen3_vl", ("Qwen3VLForConditionalGeneration",), **_decoder("qwen3_vl", "Qwen3VLForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.qwen3_vl:build_qwen3_vl",
               vision="visual.models.qwen3_vl:Qwen3VLVisionModel", prompt=_QWEN2_VL_PROMPT,
               chat_template="mmserve.prep.chat_templates:QWEN3_VL", checks_image_size=True, dummy_vision_weights=True,
               videos=True),
    FamilySpec("internvl_hf", ("InternVLForConditionalGeneration",), **_decoder("internvl", "InternVLForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.internvl:build_internvl_hf",
               vision="visual.models.internvl:InternVLVisionModel",
               prompt="mmserve.prep.multimodal.internvl:InternVLPromptProcessor",
               chat_template="mmserve.prep.chat_templates:INTERNVL", tiles_images=True),
    FamilySpec("internvl_chat", ("InternVLChatModel",), **_decoder("internvl", "InternVLChatForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.internvl_chat:build_internvl_chat",
               vision="visual.models.internvl:InternVLVisionModel",
               prompt="mmserve.prep.multimodal.internvl:InternVLChatPromptProcessor",
               chat_template="mmserve.prep.chat_templates:INTERNVL_CHAT", tiles_images=True),
    FamilySpec("gemma3", ("Gemma3ForConditionalGeneration",), **_decoder("gemma3", "Gemma3ForCausalLM"),
               test_checkpoint="mmserve.testing.checkpoints.gemma3:build_gemma3",
               vision="visual.models.gemma3:Gemma3VisionModel",
               prompt="mmserve.prep.multimodal.gemma3:Gemma3PromptProcessor",
               chat_template="mmserve.prep.chat_templates:GEMMA3"),
)  # fmt: skip

_registered: list[FamilySpec] = []  # added by `registered` (tests), in this process only


def all_families() -> tuple[FamilySpec, ...]:
    return FAMILIES + tuple(_registered)


def family(architecture: str) -> FamilySpec:
    """The family serving `architecture` (config.json's `architectures[0]`); ValueError naming those served."""
    for spec in all_families():
        if architecture in spec.architectures:
            return spec
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(architectures())}")


def architectures() -> list[str]:
    return sorted(arch for spec in all_families() for arch in spec.architectures)


def image_architectures() -> list[str]:
    """The architectures with a vision tower here (--enable_multimodal)."""
    return sorted(arch for spec in all_families() if spec.vision for arch in spec.architectures)


@contextmanager
def registered(spec: FamilySpec) -> Iterator[FamilySpec]:
    """`spec` in the table while the block runs, in this process (a test's own family); ValueError if one of its
    architectures is served already."""
    taken = sorted(set(spec.architectures) & set(architectures()))
    if taken:
        raise ValueError(f"architectures {taken} are served already")
    _registered.append(spec)
    try:
        yield spec
    finally:
        _registered.remove(spec)
