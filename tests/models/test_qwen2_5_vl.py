"""Qwen2.5-VL: our vision tower + merger (transformers' window-attention tower, packed) equals HF
Qwen2_5_VLForConditionalGeneration's image features on a tiny random checkpoint in the published layout (and the
transformers-5 dialect); the M-RoPE positions equal HF's get_rope_index; greedy generation through our LLM equals HF
generate for 1 image, 2 images of different non-square sizes and a text-only request, batched."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

from mmserve.testing.checkpoints.qwen2_5_vl import build_qwen2_5_vl, qwen2_5_vl_config
from tests.models import qwen_vl_harness as vl
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily
from visual.models.base import vision_model_class

ARCH = "Qwen2_5_VLForConditionalGeneration"
FAMILY = QwenVLFamily("qwen2_5_vl", ARCH, build_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                      Qwen2VLVideoProcessor)  # fmt: skip
SIZES = [(150, 100), (60, 200), (333, 77), (230, 170)]  # (width, height), non-square, different grids
published_dir, hf_model = vl.checkpoint_fixtures(FAMILY)


def test_published_layout(published_dir: str) -> None:
    with open(os.path.join(published_dir, "config.json")) as f:
        cfg = json.load(f)
    vc = cfg["vision_config"]
    assert cfg["architectures"] == [ARCH] and "text_config" not in cfg
    assert vc["out_hidden_size"] == cfg["hidden_size"] and vc["hidden_size"] != cfg["hidden_size"]
    # At least one full-attention block and one windowed block; windows smaller than the test images.
    assert 0 < len(vc["fullatt_block_indexes"]) < vc["depth"]
    with open(os.path.join(published_dir, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    assert {"visual.blocks.0.mlp.gate_proj.bias", "visual.blocks.0.norm1.weight", "visual.merger.ln_q.weight",
            "model.layers.0.self_attn.q_proj.bias", "lm_head.weight"} <= names  # fmt: skip
    assert not any(n.endswith("norm1.bias") or ".fc1." in n for n in names)  # RMSNorm, SwiGLU (not Qwen2-VL's)
    with open(os.path.join(published_dir, "preprocessor_config.json")) as f:
        pre = json.load(f)
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and {"min_pixels", "max_pixels"} <= set(pre)
    tokenizer = AutoTokenizer.from_pretrained(published_dir)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + CHAT.format(VISION + "Hi")


def test_7b_config_shapes() -> None:
    """The 7B-shaped config (written by `--shape 7b`) parses into Qwen2.5-VL-7B's shapes."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(**qwen2_5_vl_config("7b", torch.bfloat16))
    text, vision = config.get_text_config(), config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (3584, 28, 4)
    assert (vision.depth, vision.hidden_size, vision.intermediate_size) == (32, 1280, 3420)
    assert vision.out_hidden_size == 3584
    assert (vision.window_size, vision.fullatt_block_indexes) == (112, [7, 15, 23, 31])
    assert config.image_token_id == 151655
    # The tensors `--shape 7b` writes: Qwen2.5-VL-7B-Instruct's 8.29B parameters (without writing 16 GB here).
    import math

    from mmserve.testing.checkpoints.llama import llama_tensor_specs
    from mmserve.testing.checkpoints.qwen2_5_vl import vision_tensor_specs

    raw = qwen2_5_vl_config("7b", torch.bfloat16)
    specs = llama_tensor_specs(raw, bias=True) + vision_tensor_specs(raw["vision_config"], "visual.")
    assert sum(math.prod(s.shape) for s in specs) == 8_292_166_656


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    vision, images, ours = vl.check_vision_features(FAMILY, dialect, published_dir, hf_model, tmp_path, SIZES)
    # The windows matter at these sizes: one window per image (full attention everywhere) gives other features.
    vision.window_size = 10**4
    assert not torch.allclose(vision.encode(images[:1])[0], ours[0], atol=1e-3)


def test_mrope_positions_match_hf_get_rope_index(published_dir: str, hf_model) -> None:
    vl.check_mrope_positions(FAMILY, published_dir, hf_model, SIZES)


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine: each equals HF generate,
    whether prompts run whole or in 6-token chunks (images and their M-RoPE positions split across steps)."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cpu", chunked_prefill_size)


def test_v5_dialect_generation_matches_hf(published_dir: str, hf_model, tmp_path) -> None:
    """The transformers-5 dialect (nested text_config with rope_parameters, `model.language_model.*` /
    `model.visual.*`, processor_config.json) loads into the same model: one image, HF's greedy tokens (the same seed
    writes the same weights under either set of names)."""
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    model_dir = build_qwen2_5_vl(str(tmp_path), dialect="v5")
    prompter = prompt_processor_class(ARCH).from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir))
    vision = vision_model_class(ARCH).from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    text, image = CHAT.format(VISION + "Describe this picture."), vl.random_image(150, 100, 1)
    mm = prompter.encode(text, [image.size])
    embeds = vision.encode([vision.preprocess(image)])
    llm = LLM(model_dir, max_total_token_num=1024, device="cpu")
    items = [[MultimodalItem(offset=mm.offsets[0], embeds=embeds[0], grid_thw=mm.grid_thw[0])]]
    ours = llm.generate([mm.token_ids], SamplingParams(max_new_tokens=16, ignore_eos=True), mm_items=items)[0]
    inputs = FAMILY.hf_processor(published_dir)(text=[text], images=[image], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == mm.token_ids
    extra = {k: v for k, v in inputs.items() if k != "input_ids"}
    assert ours.token_ids == hf_greedy(hf_model, mm.token_ids, 16, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["tiny", "7b"])
def test_packed_tower_on_gpu_matches_hf_sdpa(shape: str, published_dir: str) -> None:
    """bf16 on CUDA: our packed tower (flash varlen over image and window boundaries) is as close to transformers'
    fp32 sdpa tower as transformers' own bf16 sdpa tower is, for a batch of different grids; 7b: the published tower
    shape (transformers' random init, built in memory)."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    device, dtype = torch.device("cuda"), torch.bfloat16
    ours = vision_model_class(ARCH).from_pretrained(published_dir, device, dtype)
    if shape == "7b":
        ours = vl.with_random_tower(
            ours,
            Qwen2_5_VisionTransformerPretrainedModel,
            Qwen2_5_VLConfig(**qwen2_5_vl_config("7b", dtype)).vision_config,
        )
    vl.check_packed_tower_matches_hf_sdpa(ours, device, dtype, lambda out: out.pooler_output)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_generation_matches_hf_on_gpu(published_dir: str, hf_model) -> None:
    """The engine on CUDA (Triton kernels, CUDA-graph decode, M-RoPE) with the tower on CUDA, float32: HF's tokens."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cuda", chunked_prefill_size=13)
