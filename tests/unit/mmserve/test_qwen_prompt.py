"""Qwen-family prompt processors: Qwen2-VL expansion equals transformers' Qwen2VLProcessor, with the grids M-RoPE needs;
Qwen-VL `<img>...</img>` spans become <img> + 256 <imgpad> + </img>, images resolved from the tags."""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from language.models.qwen2_vl_positions import mrope_positions
from mmserve.prep.multimodal.image_io import BadImage
from mmserve.prep.multimodal.prompt import PromptImageMismatch, prompt_processor_class
from mmserve.prep.multimodal.qwen_vl import prompt_image_items
from mmserve.prep.tokenizers import load_tokenizer
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.checkpoints.qwen_vl import build_qwen_vl

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<img></img>\n<img></img>\n"
    "Which two cities are shown in these pictures? Compare them.<|im_end|>\n<|im_start|>assistant\n"
    "The pictures show Chongqing and Beijing.<|im_end|>\n<|im_start|>user\nWhere are these two cities?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory) -> str:
    return build_qwen2_vl(str(tmp_path_factory.mktemp("q2vl")), num_shards=1)


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory) -> str:
    return build_qwen_vl(str(tmp_path_factory.mktemp("qvl")), num_shards=1)


def _image(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(
    "prompt, sizes",
    [
        (f"<|im_start|>user\n{VISION}Describe it.<|im_end|>\n<|im_start|>assistant\n", [(150, 100)]),
        (f"<|im_start|>user\n{VISION}and{VISION}compare.<|im_end|>\n", [(60, 200), (333, 77)]),
        ("<|im_start|>user\nNo image here.<|im_end|>\n", []),
    ],
)
def test_qwen2_vl_matches_hf_processor(qwen2_vl_dir: str, prompt: str, sizes: list) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    proc = prompt_processor_class("Qwen2VLForConditionalGeneration").from_pretrained(qwen2_vl_dir, tokenizer)
    assert proc.count_images(prompt) == len(sizes)
    ours = proc.encode(prompt, sizes)

    hf = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(qwen2_vl_dir),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )
    images = [_image(w, h) for w, h in sizes] or None
    out = hf(text=[prompt], images=images, return_tensors="pt")
    assert ours.token_ids == out["input_ids"][0].tolist()
    grids = [tuple(g) for g in out["image_grid_thw"].tolist()] if sizes else []
    assert ours.grid_thw == grids
    assert ours.num_tokens == [t * h * w // 4 for t, h, w in grids]
    for offset, count in zip(ours.offsets, ours.num_tokens, strict=True):
        window = ours.token_ids[offset - 1 : offset + count + 1]
        assert window == [proc.vision_start_token_id] + [proc.image_token_id] * count + [window[-1]]
        assert window[-1] == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    # What the engine derives M-RoPE positions from: each image run right after its vision start, one grid each.
    positions, _ = mrope_positions(ours.token_ids, ours.grid_thw, proc.image_token_id, proc.vision_start_token_id)
    assert positions.shape == (3, len(ours.token_ids))


def test_qwen2_vl_count_mismatch(qwen2_vl_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    proc = prompt_processor_class("Qwen2VLForConditionalGeneration").from_pretrained(qwen2_vl_dir, tokenizer)
    with pytest.raises(PromptImageMismatch):
        proc.encode(f"{VISION}{VISION}", [(100, 100)])


def test_qwen_vl_expands_spans(qwen_vl_dir: str) -> None:
    tokenizer = load_tokenizer(qwen_vl_dir)
    proc = prompt_processor_class("QWenLMHeadModel").from_pretrained(qwen_vl_dir, tokenizer)
    prompt = CHAT.replace("<img></img>\n<img></img>", "<img></img>\n<img>http://example.com/b.png</img>")
    assert proc.count_images(prompt) == 2
    ours = proc.encode(prompt, [(640, 480), (20, 30)])
    img, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<imgpad>"))
    assert ours.num_tokens == [256, 256]
    for offset in ours.offsets:
        assert ours.token_ids[offset - 1 : offset + 257] == [img] + [pad] * 256 + [end]
    # The text around the spans tokenizes as the whole prompt does (tiktoken splits at special tokens anyway).
    without_pads = [t for t in ours.token_ids if t != pad]
    assert without_pads == tokenizer.encode(CHAT)
    assert ours.token_ids.count(pad) == 512
    with pytest.raises(PromptImageMismatch):
        proc.encode(prompt, [(10, 10)])


def test_qwen_vl_image_sources(tmp_path) -> None:
    allowed = tmp_path / "images"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(b"PNGDATA")
    (tmp_path / "secret.png").write_bytes(b"SECRET")
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    sent = [{"type": "base64", "data": "AAAA"}, {"type": "url", "data": "http://h/x.jpg"}]

    prompt = "<img></img> <img>https://e.com/1.jpg</img> <img>a.png</img> <img> </img>"
    items = prompt_image_items(prompt, sent, image_dir=str(allowed))
    assert items == [sent[0], {"type": "url", "data": "https://e.com/1.jpg"},
                     {"type": "base64", "data": base64.b64encode(b"PNGDATA").decode()}, sent[1]]  # fmt: skip
    assert prompt_image_items(f"<img>{allowed / 'a.png'}</img>", [], image_dir=str(allowed))[0]["type"] == "base64"

    for bad in ["../secret.png", str(tmp_path / "secret.png"), "link.png", "missing.png", "file:///etc/passwd"]:
        with pytest.raises(BadImage):
            prompt_image_items(f"<img>{bad}</img>", [], image_dir=str(allowed))
    with pytest.raises(BadImage):
        prompt_image_items("<img>a.png</img>", [], image_dir=None)  # paths need --image_dir
    with pytest.raises(PromptImageMismatch):
        prompt_image_items("<img></img>", sent, image_dir=None)


def test_qwen_vl_processor_image_items(qwen_vl_dir: str, tmp_path) -> None:
    (tmp_path / "a.png").write_bytes(b"PNG")
    proc = prompt_processor_class("QWenLMHeadModel").from_pretrained(qwen_vl_dir, load_tokenizer(qwen_vl_dir))
    sent = [{"type": "url", "data": "http://h/x.jpg"}]
    with pytest.raises(BadImage):  # no --image_dir: paths refused
        proc.image_items("<img>a.png</img><img></img>", sent)
    proc.image_dir = str(tmp_path)
    items = proc.image_items("<img>a.png</img><img></img>", sent)
    assert items == [{"type": "base64", "data": base64.b64encode(b"PNG").decode()}, sent[0]]
