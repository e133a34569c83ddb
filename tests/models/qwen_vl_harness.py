"""What the Qwen-VL families' model tests share (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a family's tiny checkpoint and HF
model as module fixtures, random test images, and the checks against HF transformers that read the same for every
family (tower features, M-RoPE positions, greedy generation). Each family's test
module keeps what is its own: its checkpoint builder and classes, its layout and its quirks (window attention,
DeepStack)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLImageProcessor

from visual.models.base import vision_model_class

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class QwenVLFamily:
    name: str  # the checkpoint folder's name
    arch: str  # HF architectures[0]
    build: Callable[..., str]  # mmserve.testing.checkpoints builder: (out_dir, dialect=...) -> model dir
    hf_class: type  # transformers' *ForConditionalGeneration
    processor_class: type  # transformers' *Processor
    video_processor_class: type  # the processor wants one, though we refuse video

    def hf_processor(self, model_dir: str):
        return self.processor_class(
            image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            video_processor=self.video_processor_class(),
        )

    def hf_model(self, model_dir: str):
        return self.hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def checkpoint_fixtures(family: QwenVLFamily):
    """Module fixtures `published_dir` (the tiny random checkpoint in the published layout) and `hf_model` (HF's model
    on it, float32); a test module binds them under those names."""

    @pytest.fixture(scope="module")
    def published_dir(tmp_path_factory) -> str:
        return family.build(str(tmp_path_factory.mktemp(family.name)))

    @pytest.fixture(scope="module")
    def hf_model(published_dir: str):
        return family.hf_model(published_dir)

    return published_dir, hf_model


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def pooler_rows(vision, out, images) -> list[torch.Tensor]:
    """HF's per-image features where a row is the merger's output only (Qwen2-VL, Qwen2.5-VL)."""
    return list(out.pooler_output)


def check_vision_features(family: QwenVLFamily, dialect: str, published_dir: str, hf_model, tmp_path,
                          sizes: list[tuple[int, int]], hf_rows=pooler_rows):  # fmt: skip
    """Our tower (from the published layout or the transformers-5 dialect) on images of `sizes` (width, height),
    preprocessed as the visual process's worker pool runs it: token counts and grids as the prompt side computes them,
    each image's rows equal to `hf_rows` of HF's get_image_features, batched encoding equal to one image at a time.
    Returns (vision, images, ours) for a family's further checks."""
    model_dir = published_dir if dialect == "published" else family.build(str(tmp_path), dialect="v5")
    vision = vision_model_class(family.arch).from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    assert vision.hidden_size == hf_model.config.text_config.hidden_size
    preprocess = pickle.loads(pickle.dumps(vision.preprocessor()))  # as the visual process's worker pool runs it
    pils = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    images = [preprocess(pil) for pil in pils]
    hf_inputs = Qwen2VLImageProcessor.from_pretrained(model_dir)(images=pils, return_tensors="pt")
    assert [im.grid_thw for im in images] == [tuple(g) for g in hf_inputs["image_grid_thw"].tolist()]
    for im, (w, h) in zip(images, sizes, strict=True):
        assert im.num_tokens == vision.num_tokens(w, h) == im.patches // 4
        assert im.grid_thw == vision.grid_thw(w, h)
    assert len({im.num_tokens for im in images}) == len(images)
    ours = vision.encode(images)

    with torch.inference_mode():
        out = hf_model.model.get_image_features(hf_inputs["pixel_values"], image_grid_thw=hf_inputs["image_grid_thw"])
    theirs = hf_rows(vision, out, images)
    width = getattr(vision, "embed_width", vision.hidden_size)  # columns of a row: more than hidden with DeepStack
    assert len(ours) == len(theirs)
    for a, b, im in zip(ours, theirs, images, strict=True):
        assert a.shape == (im.num_tokens, width)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Batched encoding equals one image at a time (images do not attend to each other).
    torch.testing.assert_close(vision.encode(images[1:2])[0], ours[1], rtol=1e-5, atol=1e-5)
    return vision, images, ours


def check_mrope_positions(family: QwenVLFamily, published_dir: str, hf_model, sizes: list[tuple[int, int]]) -> None:
    """Our M-RoPE positions and delta for 3 images in one prompt equal HF's get_rope_index."""
    from language.models.qwen2_vl_positions import mrope_positions

    text = CHAT.format(f"Look: {VISION}and{VISION}, then{VISION}Compare.")
    images = [random_image(w, h, i) for i, (w, h) in enumerate(sizes[:3])]
    inputs = family.hf_processor(published_dir)(text=[text], images=images, return_tensors="pt")
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


def check_generation(family: QwenVLFamily, model_dir: str, hf_model, device: str, chunked_prefill_size: int,
                     dtype: str = "float32", piecewise_max_tokens: int = 0) -> None:  # fmt: skip
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine on `device` (the tower
    there too, float32; the LLM in `dtype`): each prompt equals HF's processor output and each answer HF generate's.
    piecewise_max_tokens: steps of up to that many tokens run through piecewise graphs (on CPU uncaptured)."""
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompter = prompt_processor_class(family.arch).from_pretrained(model_dir, tokenizer)
    vision = vision_model_class(family.arch).from_pretrained(model_dir, torch.device(device), torch.float32)
    processor = family.hf_processor(model_dir)
    cases = [
        (CHAT.format(VISION + "Describe this picture."), [random_image(150, 100, 1)]),
        (CHAT.format(f"{VISION}and{VISION}Compare the two cities."), [random_image(60, 200, 2),
                                                                       random_image(333, 77, 3)]),
        (CHAT.format("What is AI?"), []),
    ]  # fmt: skip
    prompts, items = [], []
    for text, images in cases:
        mm = prompter.encode(text, [im.size for im in images])
        embeds = vision.encode([vision.preprocess(im) for im in images]) if images else []
        prompts.append(mm.token_ids)
        placed = zip(mm.offsets, embeds, mm.grid_thw, strict=True)
        items.append([MultimodalItem(offset=o, embeds=e.cpu(), grid_thw=g) for o, e, g in placed])
    llm = LLM(model_dir, max_total_token_num=4096, device=device, data_type=dtype,
              chunked_prefill_size=chunked_prefill_size,
              piecewise_cuda_graph_max_tokens=piecewise_max_tokens)  # fmt: skip
    if piecewise_max_tokens and llm.engine.runner.pieces is None:  # CPU: the pieces run uncaptured
        from language.piecewise_graphs import PiecewiseGraphs

        runner = llm.engine.runner
        runner.pieces = PiecewiseGraphs(runner.model, runner.kv, runner.device, piecewise_max_tokens)
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), mm_items=items)
    for (text, images), prompt, gen in zip(cases, prompts, ours, strict=True):
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prompt
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        assert gen.token_ids == hf_greedy(hf_model, prompt, 24, **extra)


def with_random_tower(ours, tower_class: type, config):
    """`ours` with a tower of transformers' random init (seed 0) built in memory to `config` on ours' device and
    dtype: a published tower shape without writing its checkpoint."""
    param = next(ours.tower.parameters())
    torch.manual_seed(0)
    with torch.device(param.device):
        tower = tower_class._from_config(config, dtype=param.dtype)
    return type(ours)(tower, ours.processor, "bench")


def check_packed_tower_matches_hf_sdpa(ours, device: torch.device, dtype: torch.dtype,
                                       hf_rows: Callable[[object], torch.Tensor]) -> None:  # fmt: skip
    """`ours` (a tower in `dtype` on `device`): its packed encoding (flash varlen over image boundaries) of a batch of
    different grids is as close to transformers' fp32 sdpa tower (a copy of ours) as transformers' own `dtype` sdpa
    tower is; `hf_rows` turns a tower output into the rows ours writes."""
    import copy

    from visual.models.packed_attention import torch_varlen_attn

    assert torch_varlen_attn() is not None  # the packed path, not the per-image fallback
    hf_bf16 = copy.deepcopy(ours.tower)
    hf_bf16.set_attn_implementation("sdpa")
    hf_fp32 = copy.deepcopy(hf_bf16).float()
    sizes = [(150, 100), (60, 200), (333, 77), (224, 224), (640, 480)]  # within the tiny max_pixels: up to 256 tokens
    pils = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    images = [ours.preprocess(pil) for pil in pils]
    got = torch.cat(ours.encode(images)).float()
    with torch.inference_mode():
        pixels = ours.processor(images=pils, return_tensors="pt")["pixel_values"].to(device)  # HF's, on the CPU
        grid = torch.tensor([im.grid_thw for im in images], device=device)
        exact = hf_rows(hf_fp32(pixels, grid_thw=grid)).float()
        hf = hf_rows(hf_bf16(pixels.to(dtype), grid_thw=grid)).float()

    def rel(a: torch.Tensor) -> float:
        return ((a - exact).norm() / exact.norm()).item()

    assert rel(got) <= 1.5 * rel(hf) + 1e-3, (rel(got), rel(hf))
