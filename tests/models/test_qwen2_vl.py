"""Qwen2-VL: our vision tower + merger equals HF Qwen2VLForConditionalGeneration's image features on a tiny random
checkpoint in the published layout (and the transformers-5 dialect); greedy generation through our LLM equals HF
generate for 1 and 2 images batched with a text-only request."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration

import visual.models.qwen2_vl  # noqa: F401  (registers the architecture)
from mmserve.checkpoints.qwen2_vl import build_qwen2_vl
from visual.models.base import vision_model_class

SIZES = [(150, 100), (60, 200), (333, 77)]  # (width, height), non-square, different grids


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory) -> str:
    return build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="module")
def hf_model(published_dir: str) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(published_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("dialect", ["published", "v5"])
def test_vision_features_match_hf(dialect: str, published_dir: str, hf_model, tmp_path) -> None:
    model_dir = published_dir if dialect == "published" else build_qwen2_vl(str(tmp_path), dialect="v5")
    vision = vision_model_class("Qwen2VLForConditionalGeneration").from_pretrained(
        model_dir, torch.device("cpu"), torch.float32
    )
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


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("chunked_prefill_size", [4096, 6])
def test_greedy_generation_matches_hf(published_dir: str, hf_model, chunked_prefill_size: int) -> None:
    """1 image, 2 images of different sizes and a text-only prompt, batched in our engine: each equals HF generate,
    whether prompts run whole or in 6-token chunks (images and their M-RoPE positions split across steps)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from language.llm import LLM
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.multimodal.prompt import prompt_processor_class
    from tests.models.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(published_dir)
    prompter = prompt_processor_class("Qwen2VLForConditionalGeneration").from_pretrained(published_dir, tokenizer)
    vision = vision_model_class("Qwen2VLForConditionalGeneration").from_pretrained(
        published_dir, torch.device("cpu"), torch.float32
    )
    hf_processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(published_dir),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )
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
        items.append([MultimodalItem(offset=o, embeds=e, grid_thw=g) for o, e, g in placed])
    llm = LLM(published_dir, max_total_token_num=4096, device="cpu", chunked_prefill_size=chunked_prefill_size)
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), mm_items=items)

    for (text, images), prompt, gen in zip(cases, prompts, ours, strict=True):
        inputs = hf_processor(text=[text], images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prompt
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        assert gen.token_ids == hf_greedy(hf_model, prompt, 24, **extra)
