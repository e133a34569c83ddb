"""The family table (families/table.py): each family has every part its spec names, with the methods the server
calls on it, and declares exactly the optional capabilities its parts have; the lists the server checks before it
starts are the table's."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from families import FAMILIES, FamilySpec, architectures, family, image_architectures, registered

# What the engine, visual process and HTTP process call on each part (the protocols in language/models/registry.py,
# visual/models/base.py and mmserve/prep/multimodal/prompt.py).
METHODS = {
    "decoder": ("lm_config", "forward", "layers_only", "prepare_request", "checkpoint_name", "load_weights"),
    "vision": ("from_pretrained", "load_preprocessor", "preprocessor", "preprocess", "num_tokens", "encode"),
    "prompt": ("from_pretrained", "count_images", "encode"),
}
# Optional capability -> (part, the method a part that has it defines).
CAPABILITIES = {
    "checks_image_size": ("prompt", "check_image_size"),
    "images_in_prompt": ("prompt", "image_items"),
    "tiles_images": ("prompt", "encode_tiled"),
}


def missing_parts(spec: FamilySpec) -> list[str]:
    """What `spec` lacks, in words (empty when the family is whole)."""
    problems = [f"no {name}" for name in ("decoder", "config_reader", "test_checkpoint") if getattr(spec, name) is None]
    if not spec.architectures:
        problems.append("no architectures")
    if (spec.vision is None) != (spec.prompt is None) or (spec.vision is None) != (spec.chat_template is None):
        problems.append("a vision tower, a prompt processor and a chat template go together")
    parts = {}
    for name in ("decoder", "config_reader", "test_checkpoint", "vision", "prompt", "chat_template"):
        if getattr(spec, name) is None:
            continue
        try:
            parts[name] = spec.part(name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{name} {getattr(spec, name)!r} cannot be resolved: {e}")
    for name, methods in METHODS.items():
        problems += [f"{name} lacks {m}" for m in methods if name in parts and not hasattr(parts[name], m)]
    problems += [f"{name} is not callable" for name in ("config_reader", "test_checkpoint")
                 if name in parts and not callable(parts[name])]  # fmt: skip
    if "chat_template" in parts and not isinstance(parts["chat_template"], str):
        problems.append("chat_template is not a string")
    for flag, (part, method) in CAPABILITIES.items():
        if part in parts and getattr(spec, flag) != hasattr(parts[part], method):
            problems.append(f"{flag}={getattr(spec, flag)} but the {part} {'lacks' if getattr(spec, flag) else 'has'} "
                            f"{method}")  # fmt: skip
    if "vision" in parts:
        takes_dummy = "dummy" in inspect.signature(parts["vision"].from_pretrained).parameters
        if spec.dummy_vision_weights != takes_dummy:
            problems.append(f"dummy_vision_weights={spec.dummy_vision_weights} but from_pretrained's dummy is "
                            f"{'there' if takes_dummy else 'missing'}")  # fmt: skip
    return problems


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda spec: spec.name)
def test_every_family_has_its_parts(spec: FamilySpec) -> None:
    assert missing_parts(spec) == []


def test_a_family_lacking_a_part_is_found() -> None:
    llava = family("LlavaForConditionalGeneration")
    broken = {
        "vision": dataclasses.replace(llava, vision="visual.models.llava:NoSuchTower"),
        "prompt": dataclasses.replace(llava, prompt="mmserve.prep.multimodal.prompt:MultimodalPrompt"),
        "capability": dataclasses.replace(llava, checks_image_size=False),
        "template": dataclasses.replace(llava, chat_template=None),
        "builder": dataclasses.replace(llava, test_checkpoint=None),
        "decoder": dataclasses.replace(llava, decoder="language.models.llava:no_such_decoder"),
    }
    for what, spec in broken.items():
        assert missing_parts(spec), what
    assert "prompt lacks count_images" in missing_parts(broken["prompt"])
    assert "checks_image_size=False but the prompt has check_image_size" in missing_parts(broken["capability"])


def test_each_architecture_is_served_by_one_family() -> None:
    names = [arch for spec in FAMILIES for arch in spec.architectures]
    assert len(names) == len(set(names)) == len(architectures())
    assert len({spec.name for spec in FAMILIES}) == len(FAMILIES)
    assert set(image_architectures()) == {arch for spec in FAMILIES if spec.vision for arch in spec.architectures}
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: .*LlamaForCausalLM"):
        family("GPT2LMHeadModel")


def test_registering_a_family_adds_it_for_the_block_only() -> None:
    toy = dataclasses.replace(family("LlamaForCausalLM"), name="toy", architectures=("ToyForCausalLM",))
    with registered(toy):
        assert family("ToyForCausalLM") is toy and "ToyForCausalLM" in architectures()
        with pytest.raises(ValueError, match="served already"):
            with registered(dataclasses.replace(toy, name="again")):
                pass
    assert "ToyForCausalLM" not in architectures()
    with pytest.raises(ValueError, match="served already"):
        with registered(dataclasses.replace(toy, architectures=("LlamaForCausalLM",))):
            pass
