"""Qwen3-VL (dense): our vision tower + mergers (transformers' tower, packed, with the position-table interpolation
built on the host) equal HF Qwen3VLForConditionalGeneration's image features and DeepStack features on a tiny random
checkpoint in the published layout (and the transformers-5 dialect); the M-RoPE positions equal HF's get_rope_index;
greedy generation through our LLM (Qwen3 q/k norm, interleaved M-RoPE, DeepStack added after the first layers)
equals HF generate for 1 image, 2 images of different non-square sizes and a text-only request, batched, with prompts
whole and in small chunks."""

from __future__ import annotations

import glob
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from mmserve.checkpoints.qwen3_vl import build_qwen3_vl, qwen3_vl_config
from visual.models.base import vision_model_class

ARCH = "Qwen3VLForConditionalGeneration"
SIZES = [(150, 100), (60, 200), (333, 77), (230, 170)]  # (width, height), non-square, different grids
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory) -> str:
    return build_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl")))


@pytest.fixture(scope="module")
def hf_model(published_dir: str) -> Qwen3VLForConditionalGeneration:
    return Qwen3VLForConditionalGeneration.from_pretrained(published_dir, dtype=torch.float32).eval()


def hf_processor(model_dir: str) -> Qwen3VLProcessor:
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=Qwen3VLVideoProcessor(),
    )


def test_published_layout(published_dir: str, hf_model) -> None:
    with open(os.path.join(published_dir, "config.json")) as f:
        cfg = json.load(f)
    text, vc = cfg["text_config"], cfg["vision_config"]
    assert cfg["architectures"] == [ARCH] and text["rope_scaling"]["mrope_interleaved"] is True
    assert vc["out_hidden_size"] == text["hidden_size"] and vc["hidden_size"] != text["hidden_size"]
    # DeepStack into fewer layers than the LLM has: the last layer gets none.
    assert 0 < len(vc["deepstack_visual_indexes"]) < text["num_hidden_layers"]
    names = set()
    for path in glob.glob(os.path.join(published_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    assert names == set(hf_model.state_dict())  # exactly HF's tensors, under the published names
    assert {"model.visual.deepstack_merger_list.1.norm.weight", "model.visual.pos_embed.weight",
            "model.language_model.layers.0.self_attn.q_norm.weight", "lm_head.weight"} <= names  # fmt: skip
    with open(os.path.join(published_dir, "preprocessor_config.json")) as f:
        pre = json.load(f)
    assert pre["patch_size"] == 16 and set(pre["size"]) == {"shortest_edge", "longest_edge"}
    tokenizer = AutoTokenizer.from_pretrained(published_dir)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == CHAT.format(VISION + "Hi")  # Qwen3-VL's template has no default system turn


def test_8b_config_shapes() -> None:
    """The 8B-shaped config (written by `--shape 8b`) parses into Qwen3-VL-8B's shapes, and its tensors hold
    Qwen3-VL-8B-Instruct's 8.77B parameters (without writing 17 GB here)."""
    from transformers import Qwen3VLConfig

    from mmserve.checkpoints.qwen3_vl import text_tensor_specs, vision_tensor_specs

    raw = qwen3_vl_config("8b", torch.bfloat16)
    config = Qwen3VLConfig(**raw)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, text.head_dim) == (4096, 36, 8, 128)
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["mrope_interleaved"]
    assert (vision.depth, vision.hidden_size, vision.deepstack_visual_indexes) == (27, 1152, [8, 16, 24])
    assert config.image_token_id == 151655
    specs = text_tensor_specs(raw["text_config"], "model.language_model.")
    specs += vision_tensor_specs(raw["vision_config"], "model.visual.")
    assert round(sum(math.prod(s.shape) for s in specs) / 1e9, 2) == 8.77


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    model_dir = published_dir if dialect == "published" else build_qwen3_vl(str(tmp_path), dialect="v5")
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
        out = hf_model.model.get_image_features(pixels, image_grid_thw=grid)
    hidden, k = vision.hidden_size, len(out.deepstack_features)
    assert k == 2 and vision.embed_width == (1 + k) * hidden
    # transformers splits the features per image since 5.2x; 5.17 splits only pooler_output.
    sizes = [im.num_tokens for im in images]
    per_image = lambda f: f if isinstance(f, (list, tuple)) else torch.split(f, sizes)  # noqa: E731
    features = [per_image(out.pooler_output)] + [per_image(f) for f in out.deepstack_features]
    for i, (row, im) in enumerate(zip(ours, images, strict=True)):
        assert row.shape == (im.num_tokens, (1 + k) * hidden)
        theirs = [feature[i] for feature in features]
        for j, expected in enumerate(theirs):
            torch.testing.assert_close(row[:, j * hidden : (j + 1) * hidden], expected, rtol=1e-5, atol=1e-5)
    # Batched encoding equals one image at a time (images do not attend to each other).
    torch.testing.assert_close(vision.encode(images[1:2])[0], ours[1], rtol=1e-5, atol=1e-5)


def test_mrope_positions_match_hf_get_rope_index(published_dir: str, hf_model) -> None:
    from language.models.qwen2_vl_positions import mrope_positions

    text = CHAT.format(f"Look: {VISION}and{VISION}, then{VISION}Compare.")
    images = [_image(w, h, i) for i, (w, h) in enumerate(SIZES[:3])]
    inputs = hf_processor(published_dir)(text=[text], images=images, return_tensors="pt")
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


def test_images_obey_the_pixel_bounds(published_dir: str) -> None:
    """min_pixels / max_pixels of preprocessor_config.json: a tiny image is scaled up to at least min_pixels, a large
    one down to at most max_pixels, in the prompt's token count and in the tower's input alike."""
    from mmserve.checkpoints.qwen3_vl import TINY_MAX_PIXELS, TINY_MIN_PIXELS
    from mmserve.multimodal.prompt import prompt_processor_class

    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, AutoTokenizer.from_pretrained(published_dir))
    vision = vision_model_class(ARCH).from_pretrained(published_dir, torch.device("cpu"), torch.float32)
    for size in [(20, 30), (1000, 700)]:
        t, h, w = prompter.grid_thw(*size)
        assert TINY_MIN_PIXELS <= h * w * 16 * 16 <= TINY_MAX_PIXELS
        assert vision.preprocess(_image(*size, 0)).grid_thw == (t, h, w)


def _check_generation(model_dir: str, hf_model, device: str, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine on `device` (the tower
    there too, float32): each prompt equals HF's processor output and each answer HF generate's."""
    from language.llm import LLM
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompter = prompt_processor_class(ARCH).from_pretrained(model_dir, tokenizer)
    vision = vision_model_class(ARCH).from_pretrained(model_dir, torch.device(device), torch.float32)
    processor = hf_processor(model_dir)
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
    llm = LLM(model_dir, max_total_token_num=4096, device=device, dtype="float32",
              chunked_prefill_size=chunked_prefill_size)  # fmt: skip
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), mm_items=items)
    for (text, images), prompt, gen in zip(cases, prompts, ours, strict=True):
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prompt
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        assert gen.token_ids == hf_greedy(hf_model, prompt, 24, **extra)


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """Whole prompts, and 6-token chunks: images, their DeepStack rows and their M-RoPE positions split across
    steps."""
    _check_generation(published_dir, hf_model, "cpu", chunked_prefill_size)


def test_deepstack_changes_the_answer(published_dir: str, hf_model) -> None:
    """The DeepStack rows matter: zeroing them changes HF's logits, and our engine follows (a test of the add, not
    only of the main embedding's splice)."""
    from language.llm import LLM
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.multimodal.prompt import prompt_processor_class

    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, AutoTokenizer.from_pretrained(published_dir))
    vision = vision_model_class(ARCH).from_pretrained(published_dir, torch.device("cpu"), torch.float32)
    image = _image(230, 170, 7)
    mm = prompter.encode(CHAT.format(VISION + "Describe."), [image.size])
    rows = vision.encode([vision.preprocess(image)])[0]
    flat = rows.clone()
    flat[:, vision.hidden_size :] = 0
    llm = LLM(published_dir, max_total_token_num=1024, device="cpu", prefix_cache=False)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with_rows, without = (
        llm.generate([mm.token_ids], params, mm_items=[[MultimodalItem(mm.offsets[0], e, grid_thw=mm.grid_thw[0])]])
        for e in (rows, flat)
    )
    assert with_rows[0].token_ids != without[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_generation_matches_hf_on_gpu(published_dir: str, hf_model) -> None:
    """The engine on CUDA (Triton kernels incl. q/k norm and interleaved M-RoPE, CUDA-graph decode) with the tower on
    CUDA, float32: HF's tokens."""
    _check_generation(published_dir, hf_model, "cuda", chunked_prefill_size=13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["tiny", "8b"])
def test_packed_tower_on_gpu_matches_hf_sdpa(shape: str, published_dir: str) -> None:
    """bf16 on CUDA: our packed tower (flash varlen over image boundaries, host-built interpolation) is as close to
    transformers' fp32 sdpa tower as transformers' own bf16 sdpa tower is, main and DeepStack features alike, for a
    batch of different grids; 8b: the published tower shape (transformers' random init, built in memory)."""
    import copy

    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower

    from visual.models.packed_attention import torch_varlen_attn
    from visual.models.qwen3_vl import Qwen3VLVisionModel

    assert torch_varlen_attn() is not None  # the packed path, not the per-image fallback
    device, dtype = torch.device("cuda"), torch.bfloat16
    ours = vision_model_class(ARCH).from_pretrained(published_dir, device, dtype)
    if shape == "8b":
        config = Qwen3VLConfig(**qwen3_vl_config("8b", dtype)).vision_config
        torch.manual_seed(0)
        with torch.device(device):
            tower = Tower._from_config(config, dtype=dtype)
        ours = Qwen3VLVisionModel(tower, ours.processor, "bench")
    hf_bf16 = copy.deepcopy(ours.tower)
    hf_bf16.set_attn_implementation("sdpa")
    hf_fp32 = copy.deepcopy(hf_bf16).float()
    sizes = [(150, 100), (60, 200), (333, 77), (224, 224), (640, 480)]
    images = [ours.preprocess(_image(w, h, i)) for i, (w, h) in enumerate(sizes)]
    got = torch.cat(ours.encode(images)).float()
    with torch.inference_mode():
        pixels = torch.cat([im.pixel_values for im in images]).to(device)
        grid = torch.tensor([im.grid_thw for im in images], device=device)

        def rows(out) -> torch.Tensor:
            return torch.cat([out.pooler_output, *out.deepstack_features], dim=1).float()

        exact = rows(hf_fp32(pixels, grid_thw=grid))
        hf = rows(hf_bf16(pixels.to(dtype), grid_thw=grid))

    def rel(a: torch.Tensor) -> float:
        return ((a - exact).norm() / exact.norm()).item()

    assert rel(got) <= 1.5 * rel(hf) + 1e-3, (rel(got), rel(hf))
