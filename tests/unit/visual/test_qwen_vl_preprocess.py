"""The Qwen-VL families' preprocessing, split between the worker pool (uint8 image, resized on the CPU) and the tower's
device (rescale, normalize, patchify): the tower gets exactly the pixels of transformers' processor in one call, for
sizes and aspect ratios at and beyond the min/max pixel edges, images alone and batched."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor

from mmserve.testing.checkpoints.qwen2_vl import CLIP_MEAN, CLIP_STD
from visual.models.qwen2_vl import Qwen2VLPreprocessor

MIN_PIXELS = 56 * 56
# (patch size, max pixels): Qwen2-VL and Qwen2.5-VL (14 px patches), Qwen3-VL (16 px); a small max so that large
# images downscale, and the published 7B's
PROCESSORS = [(14, 28 * 28 * 64), (16, 32 * 32 * 64), (14, 12845056)]
SIZES = [  # (width, height)
    (336, 336),  # a multiple of 28: no resize at 14 px patches
    (896, 896),
    (640, 480),
    (448, 252),
    (1344, 1008),
    (20, 20),  # below min_pixels: scaled up
    (56, 56),  # exactly min_pixels
    (57, 55),
    (33, 700),  # tall
    (2000, 100),  # wide: aspect 20
    (224, 224),  # exactly max_pixels at 14 px patches and the small max (50176)
    (230, 224),  # just above it
]


def processor(patch: int, max_pixels: int) -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(
        patch_size=patch, min_pixels=MIN_PIXELS, max_pixels=max_pixels, image_mean=CLIP_MEAN, image_std=CLIP_STD
    )


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(("patch", "max_pixels"), PROCESSORS)
def test_the_split_processor_gives_transformers_pixels(patch: int, max_pixels: int) -> None:
    hf = processor(patch, max_pixels)
    ours = pickle.loads(pickle.dumps(Qwen2VLPreprocessor(hf, merge_size=2)))  # as the worker pool runs it
    for i, (w, h) in enumerate(SIZES):
        pil = image(w, h, i)
        want = hf(images=[pil], return_tensors="pt")
        got = ours(pil)
        assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist()), (w, h)
        assert torch.equal(ours.to_patches([got.pixel_values]), want["pixel_values"]), (w, h)


def test_the_worker_hands_over_the_resized_uint8_image() -> None:
    """1 byte per pixel and channel: 8x fewer than the processor's float patches (which repeat each frame twice)."""
    ours = Qwen2VLPreprocessor(processor(14, 12845056), merge_size=2)
    for w, h in [(896, 896), (640, 480)]:
        got = ours(image(w, h))
        _, grid_h, grid_w = got.grid_thw
        assert got.pixel_values.dtype == torch.uint8
        assert got.pixel_values.shape == (3, grid_h * 14, grid_w * 14)
        assert got.patches == grid_h * grid_w


def test_a_batch_of_mixed_sizes_gives_each_image_its_pixels_in_order() -> None:
    hf = processor(14, 28 * 28 * 64)
    ours = Qwen2VLPreprocessor(hf, merge_size=2)
    pils = [image(w, h, i) for i, (w, h) in enumerate([(336, 336), (640, 480), (336, 336), (33, 700)])]
    want = hf(images=pils, return_tensors="pt")["pixel_values"]
    assert torch.equal(ours.to_patches([ours(pil).pixel_values for pil in pils]), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_half_on_cuda_equals_transformers_on_the_cpu() -> None:
    """Rescale + normalize is one subtraction and one division per value, exact on either device; and the device
    half never makes the host wait for the GPU (once warm: the first call uploads the processor's mean and std)."""
    hf = processor(14, 12845056)
    ours = Qwen2VLPreprocessor(hf, merge_size=2)
    pils = [image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    resized = [ours(pil).pixel_values.cuda() for pil in pils]
    ours.to_patches(resized[:1])
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ours.to_patches(resized)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.is_cuda
    assert torch.equal(got.cpu(), hf(images=pils, return_tensors="pt")["pixel_values"])
