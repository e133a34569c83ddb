"""A family added through the one table and nothing else: `ToyVLForConditionalGeneration`, Qwen2-VL's parts under a
new architecture name with its own checkpoint builder, registered for this module only (`families.registered`).
Its prompt processor, vision tower, decoder, config reader and chat template are all found through the table, and
it runs end to end on CPU (prompt expansion, tower, engine) to HF's greedy tokens on the same weights."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor

from families import family, registered
from mmserve.prep.chat_templates import QWEN2_VL, builtin_chat_template
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from tests.models import qwen_vl_harness as vl
from tests.models.qwen_vl_harness import QwenVLFamily

ARCH = "ToyVLForConditionalGeneration"
TOY = dataclasses.replace(family("Qwen2VLForConditionalGeneration"), name="toy_vl", architectures=(ARCH,),
                          test_checkpoint=f"{__name__}:build_toy_vl")  # fmt: skip


def build_toy_vl(out_dir: str, dialect: str = "published") -> str:
    """The toy family's checkpoint: a tiny Qwen2-VL one whose config.json names the toy architecture."""
    build_qwen2_vl(out_dir, dialect=dialect)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [ARCH]
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    with pytest.raises(ValueError, match=f"unsupported architecture '{ARCH}'"):
        family(ARCH)  # nothing serves it but the table's entry
    with registered(TOY):
        yield


@pytest.fixture(scope="module")
def toy_family(toy_registered) -> QwenVLFamily:
    build = family(ARCH).part("test_checkpoint")
    return QwenVLFamily("toy_vl", ARCH, build, Qwen2VLForConditionalGeneration, Qwen2VLProcessor,
                        Qwen2VLVideoProcessor)  # fmt: skip


@pytest.fixture(scope="module")
def toy_dir(toy_family, tmp_path_factory) -> str:
    return toy_family.build(str(tmp_path_factory.mktemp("toy_vl")))


def test_the_toy_family_generates_as_hf(toy_family: QwenVLFamily, toy_dir: str) -> None:
    with open(os.path.join(toy_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == [ARCH]
    assert builtin_chat_template(ARCH) == QWEN2_VL
    vl.check_generation(toy_family, toy_dir, toy_family.hf_model(toy_dir), "cpu", chunked_prefill_size=4096)
