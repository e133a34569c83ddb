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

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl, qwen3_vl_config
from tests.models import qwen_vl_harness as vl
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily
from visual.models.base import vision_model_class

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

ARCH = "Qwen3VLForConditionalGeneration"
FAMILY = QwenVLFamily("qwen3_vl", ARCH, build_qwen3_vl, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                      Qwen3VLVideoProcessor)  # fmt: skip
SIZES = [(150, 100), (60, 200), (333, 77), (230, 170)]  # (width, height), non-square, different grids
published_dir, hf_model = vl.checkpoint_fixtures(FAMILY)


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

    from mmserve.testing.checkpoints.qwen3_vl import text_tensor_specs, vision_tensor_specs

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


def deepstack_rows(vision, out, images) -> list[torch.Tensor]:
    """HF's per-image rows as our tower writes them: the merger's output, then each DeepStack merger's."""
    hidden, k = vision.hidden_size, len(out.deepstack_features)
    assert k == 2 and vision.embed_width == (1 + k) * hidden
    # transformers splits the features per image since 5.2x; 5.17 splits only pooler_output.
    sizes = [im.num_tokens for im in images]
    per_image = lambda f: f if isinstance(f, (list, tuple)) else torch.split(f, sizes)  # noqa: E731
    features = [per_image(out.pooler_output)] + [per_image(f) for f in out.deepstack_features]
    return [torch.cat([feature[i] for feature in features], dim=1) for i in range(len(images))]


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    vl.check_vision_features(FAMILY, dialect, published_dir, hf_model, tmp_path, SIZES, hf_rows=deepstack_rows)


def test_mrope_positions_match_hf_get_rope_index(published_dir: str, hf_model) -> None:
    vl.check_mrope_positions(FAMILY, published_dir, hf_model, SIZES)


def test_video_prompt_and_positions_match_hf(published_dir: str, hf_model) -> None:
    """A video beside an image: our prompt equals Qwen3VLProcessor's (`<t seconds>` and a vision block per temporal
    patch), and the M-RoPE positions of its runs (each a (1, h, w) grid) equal HF's get_rope_index."""
    from language.models.qwen2_vl_positions import mrope_positions
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from mmserve.testing.videos import clip, decoded
    from visual.video_decode import probe_video

    data, sampling = clip(112, 84, 3, 10, seed=1), {"fps": 2.0, "max_pixels": 32 * 32 * 6 * 8}
    text = CHAT.format(f"{VIDEO}and{VISION}What happens?")
    image = vl.random_image(90, 60, 0)
    prompter = prompt_processor_class(FAMILY.arch).from_pretrained(published_dir, AutoTokenizer.from_pretrained(
        published_dir))  # fmt: skip
    plan = prompter.plan_video(probe_video(data), sampling)
    ours = prompter.encode(text, [image.size], [plan])
    vp = prompter.video_processor
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(published_dir),
                                 tokenizer=prompter.tokenizer, video_processor=vp)  # fmt: skip
    frames, metadata = decoded(data)
    size = {"shortest_edge": vp.size.shortest_edge, "longest_edge": sampling["max_pixels"]}
    inputs = processor(text=[text], images=[image], videos=[frames], video_metadata=[metadata], return_tensors="pt",
                       videos_kwargs={"do_sample_frames": True, "fps": sampling["fps"], "size": size})  # fmt: skip
    assert ours.token_ids == inputs["input_ids"][0].tolist()
    assert tuple(inputs["video_grid_thw"][0].tolist()) == plan.grid_thw and len(ours.offsets) == 1 + plan.grid_thw[0]
    theirs, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"],
    )  # fmt: skip
    config = hf_model.config
    positions, our_delta = mrope_positions(ours.token_ids, ours.grid_thw, config.image_token_id,
                                           config.vision_start_token_id, config.vision_config.spatial_merge_size,
                                           config.video_token_id, ours.second_per_grid_t)  # fmt: skip
    assert torch.equal(positions, theirs[:, 0])
    assert our_delta == int(delta)


def test_images_obey_the_pixel_bounds(published_dir: str) -> None:
    """min_pixels / max_pixels of preprocessor_config.json: a tiny image is scaled up to at least min_pixels, a large
    one down to at most max_pixels, in the prompt's token count and in the tower's input alike."""
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from mmserve.testing.checkpoints.qwen3_vl import TINY_MAX_PIXELS, TINY_MIN_PIXELS

    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, AutoTokenizer.from_pretrained(published_dir))
    vision = vision_model_class(ARCH).from_pretrained(published_dir, torch.device("cpu"), torch.float32)
    for size in [(20, 30), (1000, 700)]:
        t, h, w = prompter.grid_thw(*size)
        assert TINY_MIN_PIXELS <= h * w * 16 * 16 <= TINY_MAX_PIXELS
        assert vision.preprocess(vl.random_image(*size, 0)).grid_thw == (t, h, w)


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """Whole prompts, and 6-token chunks: images, their DeepStack rows and their M-RoPE positions split across
    steps."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cpu", chunked_prefill_size)


def test_greedy_generation_through_piecewise_graphs_matches_hf(published_dir: str, hf_model) -> None:
    """Steps that splice images (DeepStack adds to them between layers) run eagerly, the rest piece by piece."""
    vl.check_generation(FAMILY, published_dir, hf_model, "cpu", 6, piecewise_max_tokens=32)


def test_deepstack_changes_the_answer(published_dir: str, hf_model) -> None:
    """The DeepStack rows matter: zeroing them changes HF's logits, and our engine follows (a test of the add, not
    only of the main embedding's splice)."""
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    prompter = prompt_processor_class(ARCH).from_pretrained(published_dir, AutoTokenizer.from_pretrained(published_dir))
    vision = vision_model_class(ARCH).from_pretrained(published_dir, torch.device("cpu"), torch.float32)
    image = vl.random_image(230, 170, 7)
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
    vl.check_generation(FAMILY, published_dir, hf_model, "cuda", chunked_prefill_size=13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["tiny", "8b"])
def test_packed_tower_on_gpu_matches_hf_sdpa(shape: str, published_dir: str) -> None:
    """bf16 on CUDA: our packed tower (flash varlen over image boundaries, host-built interpolation) is as close to
    transformers' fp32 sdpa tower as transformers' own bf16 sdpa tower is, main and DeepStack features alike, for a
    batch of different grids; 8b: the published tower shape (transformers' random init, built in memory)."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower

    device, dtype = torch.device("cuda"), torch.bfloat16
    ours = vision_model_class(ARCH).from_pretrained(published_dir, device, dtype)
    if shape == "8b":
        ours = vl.with_random_tower(ours, Tower, Qwen3VLConfig(**qwen3_vl_config("8b", dtype)).vision_config)
    vl.check_packed_tower_matches_hf_sdpa(
        ours, device, dtype, lambda out: torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    )
