"""Qwen2.5-VL: our vision tower + merger (transformers' window-attention tower, packed) equals HF
Qwen2_5_VLForConditionalGeneration's image features on a tiny random checkpoint in the published layout (and the
transformers-5 dialect); the M-RoPE positions equal HF's get_rope_index; greedy generation through our LLM equals HF
generate for 1 image, 2 images of different non-square sizes and a text-only request, batched."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from mmserve.checkpoints.qwen2_5_vl import build_qwen2_5_vl, qwen2_5_vl_config
from visual.models.base import vision_model_class

ARCH = "Qwen2_5_VLForConditionalGeneration"
SIZES = [(150, 100), (60, 200), (333, 77), (230, 170)]  # (width, height), non-square, different grids
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory) -> str:
    return build_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def hf_model(published_dir: str) -> Qwen2_5_VLForConditionalGeneration:
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(published_dir, dtype=torch.float32).eval()


def _hf_processor(model_dir: str) -> Qwen2_5_VLProcessor:
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=Qwen2VLVideoProcessor(),
    )


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

    from mmserve.checkpoints.llama import llama_tensor_specs
    from mmserve.checkpoints.qwen2_5_vl import vision_tensor_specs

    raw = qwen2_5_vl_config("7b", torch.bfloat16)
    specs = llama_tensor_specs(raw, bias=True) + vision_tensor_specs(raw["vision_config"], "visual.")
    assert sum(math.prod(s.shape) for s in specs) == 8_292_166_656


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    model_dir = published_dir if dialect == "published" else build_qwen2_5_vl(str(tmp_path), dialect="v5")
    vision = vision_model_class(ARCH).from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    assert vision.hidden_size == hf_model.config.text_config.hidden_size
    preprocess = pickle.loads(pickle.dumps(vision.preprocessor()))  # as the visual process's worker pool runs it
    images = [preprocess(_image(w, h, i)) for i, (w, h) in enumerate(SIZES)]
    for im, (w, h) in zip(images, SIZES, strict=True):
        assert im.num_tokens == vision.num_tokens(w, h) == im.pixel_values.shape[0] // 4
        assert im.grid_thw == vision.grid_thw(w, h)
    assert len({im.num_tokens for im in images}) == len(images)
    ours = vision.encode(images)

    with torch.inference_mode():
        pixels = torch.cat([im.pixel_values for im in images])
        grid = torch.tensor([im.grid_thw for im in images])
        theirs = hf_model.model.get_image_features(pixels, image_grid_thw=grid).pooler_output
    assert len(ours) == len(theirs)
    for a, b, im in zip(ours, theirs, images, strict=True):
        assert a.shape == (im.num_tokens, vision.hidden_size)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Batched encoding equals one image at a time (images do not attend to each other).
    torch.testing.assert_close(vision.encode(images[1:2])[0], ours[1], rtol=1e-5, atol=1e-5)
    # The windows matter at these sizes: one window per image (full attention everywhere) gives other features.
    vision.window_size = 10**4
    assert not torch.allclose(vision.encode(images[:1])[0], ours[0], atol=1e-3)


def test_mrope_positions_match_hf_get_rope_index(published_dir: str, hf_model) -> None:
    from language.models.qwen2_vl_positions import mrope_positions

    text = CHAT.format(f"Look: {VISION}and{VISION}, then{VISION}Compare.")
    images = [_image(w, h, i) for i, (w, h) in enumerate(SIZES[:3])]
    inputs = _hf_processor(published_dir)(text=[text], images=images, return_tensors="pt")
    theirs, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    config = hf_model.config
    ours, our_delta = mrope_positions(
        inputs["input_ids"][0].tolist(),
        inputs["image_grid_thw"].tolist(),
        image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        spatial_merge_size=config.vision_config.spatial_merge_size,
    )
    assert torch.equal(ours, theirs[:, 0])
    assert our_delta == int(delta)


def test_video_placeholder_is_refused(published_dir: str) -> None:
    from mmserve.multimodal.prompt import prompt_processor_class
    from mmserve.protocol import BadRequest

    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, AutoTokenizer.from_pretrained(published_dir))
    with pytest.raises(BadRequest, match="video input is not supported"):
        prompter.count_images(CHAT.format("<|vision_start|><|video_pad|><|vision_end|>What happens?"))


def _check_generation(published_dir: str, hf_model, device: str, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine on `device` (the tower
    there too, float32): each prompt equals HF's processor output and each answer HF generate's."""
    from language.llm import LLM
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(published_dir)
    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, tokenizer)
    vision = vision_model_class(ARCH).from_pretrained(published_dir, torch.device(device), torch.float32)
    hf_processor = _hf_processor(published_dir)
    cases = [
        (CHAT.format(VISION + "Describe this picture."), [_image(150, 100, 1)]),
        (CHAT.format(f"{VISION}and{VISION}Compare the two cities."), [_image(60, 200, 2), _image(333, 77, 3)]),
        (CHAT.format("What is AI?"), []),
    ]
    prompts, items = [], []
    for text, images in cases:
        mm = prompter.encode(text, [im.size for im in images])
        embeds = vision.encode([vision.preprocess(im) for im in images]) if images else []
        prompts.append(mm.token_ids)
        placed = zip(mm.offsets, embeds, mm.grid_thw, strict=True)
        items.append([MultimodalItem(offset=o, embeds=e.cpu(), grid_thw=g) for o, e, g in placed])
    llm = LLM(published_dir, max_total_token_num=4096, device=device, dtype="float32",
              chunked_prefill_size=chunked_prefill_size)  # fmt: skip
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), mm_items=items)
    for (text, images), prompt, gen in zip(cases, prompts, ours, strict=True):
        inputs = hf_processor(text=[text], images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prompt
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        assert gen.token_ids == hf_greedy(hf_model, prompt, 24, **extra)


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine: each equals HF generate,
    whether prompts run whole or in 6-token chunks (images and their M-RoPE positions split across steps)."""
    _check_generation(published_dir, hf_model, "cpu", chunked_prefill_size)


def test_v5_dialect_generation_matches_hf(published_dir: str, hf_model, tmp_path) -> None:
    """The transformers-5 dialect (nested text_config with rope_parameters, `model.language_model.*` /
    `model.visual.*`, processor_config.json) loads into the same model: one image, HF's greedy tokens (the same seed
    writes the same weights under either set of names)."""
    from language.llm import LLM
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    model_dir = build_qwen2_5_vl(str(tmp_path), dialect="v5")
    prompter = prompt_processor_class(ARCH).from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir))
    vision = vision_model_class(ARCH).from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    text, image = CHAT.format(VISION + "Describe this picture."), _image(150, 100, 1)
    mm = prompter.encode(text, [image.size])
    embeds = vision.encode([vision.preprocess(image)])
    llm = LLM(model_dir, max_total_token_num=1024, device="cpu")
    items = [[MultimodalItem(offset=mm.offsets[0], embeds=embeds[0], grid_thw=mm.grid_thw[0])]]
    ours = llm.generate([mm.token_ids], SamplingParams(max_new_tokens=16, ignore_eos=True), mm_items=items)[0]
    inputs = _hf_processor(published_dir)(text=[text], images=[image], return_tensors="pt")
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
    import copy

    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from visual.models.packed_attention import torch_varlen_attn
    from visual.models.qwen2_5_vl import Qwen2_5_VLVisionModel

    assert torch_varlen_attn() is not None  # the packed path, not the per-image fallback
    device, dtype = torch.device("cuda"), torch.bfloat16
    ours = vision_model_class(ARCH).from_pretrained(published_dir, device, dtype)
    if shape == "7b":
        config = Qwen2_5_VLConfig(**qwen2_5_vl_config("7b", dtype)).vision_config
        torch.manual_seed(0)
        with torch.device(device):
            tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)
        ours = Qwen2_5_VLVisionModel(tower, ours.processor, "bench")
    hf_bf16 = copy.deepcopy(ours.tower)
    hf_bf16.set_attn_implementation("sdpa")
    hf_fp32 = copy.deepcopy(hf_bf16).float()
    sizes = [(150, 100), (60, 200), (333, 77), (224, 224), (640, 480)]  # within the tiny max_pixels: up to 256 tokens
    images = [ours.preprocess(_image(w, h, i)) for i, (w, h) in enumerate(sizes)]
    got = torch.cat(ours.encode(images)).float()
    with torch.inference_mode():
        pixels = torch.cat([im.pixel_values for im in images]).to(device)
        grid = torch.tensor([im.grid_thw for im in images], device=device)
        exact = hf_fp32(pixels, grid_thw=grid).pooler_output
        hf = hf_bf16(pixels.to(dtype), grid_thw=grid).pooler_output.float()

    def rel(a: torch.Tensor) -> float:
        return ((a - exact).norm() / exact.norm()).item()

    assert rel(got) <= 1.5 * rel(hf) + 1e-3, (rel(got), rel(hf))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_generation_matches_hf_on_gpu(published_dir: str, hf_model) -> None:
    """The engine on CUDA (Triton kernels, CUDA-graph decode, M-RoPE) with the tower on CUDA, float32: HF's tokens."""
    _check_generation(published_dir, hf_model, "cuda", chunked_prefill_size=13)
