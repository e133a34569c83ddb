"""On a GPU: the vision towers' CUDA graphs (`visual/tower_graphs.py`) give embeddings bit-equal to the eager tower's,
for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (tiny checkpoints in bf16) and a 7B-shaped Qwen2-VL tower (random weights): a
key is captured the second time it is seen, replayed with other pixels, dropped when the LRU is full and captured
again; graphs sharing the memory pool replay in any order; a batch over the budget stays eager; start-up captures a
lone 336 px image's graph. Skipped without CUDA; run on the GPU host:

    pytest -q tests/models/test_tower_graphs_gpu.py"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from mmserve.testing.checkpoints.qwen2_5_vl import build_qwen2_5_vl
from mmserve.testing.checkpoints.qwen2_vl import (
    CLIP_MEAN,
    CLIP_STD,
    build_qwen2_vl,
    qwen2_vl_config,
    vision_tensor_specs,
)
from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl
from mmserve.testing.checkpoints.writer import make_tensor
from visual.models.base import vision_model_class
from visual.models.qwen2_vl import Qwen2VLVisionModel
from visual.process import use_tower_graphs, warm_up_tower
from visual.tower_graphs import TowerGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
BF16 = torch.bfloat16
MAX_PATCHES = 600

# (width, height) of each image of a batch; each batch is its own key
LONE = [(224, 224)]  # ~200-256 patches: our varlen kernel (at least one query tile)
RAGGED = [(112, 56), (168, 112)]  # small images of two sizes: torch's varlen flash
UNIFORM = [(56, 56)] * 3  # one small size: the dense flash path
TOO_LARGE = [(448, 448)]  # ~800-1000 patches: over MAX_PATCHES
BUILDERS = {
    "Qwen2VLForConditionalGeneration": (build_qwen2_vl, 28),
    "Qwen2_5_VLForConditionalGeneration": (build_qwen2_5_vl, 28),
    "Qwen3VLForConditionalGeneration": (build_qwen3_vl, 32),
}


def _noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny_vision(request, tmp_path_factory):
    build, unit = BUILDERS[request.param]
    model_dir = build(str(tmp_path_factory.mktemp(request.param)), dtype=BF16, max_pixels=unit * unit * 256)
    return vision_model_class(request.param).from_pretrained(model_dir, CUDA, BF16)


@pytest.fixture(scope="module")
def vision_7b() -> Qwen2VLVisionModel:
    """Qwen2-VL-7B's tower shape with random weights, built in memory (as benchmarks/tower_bench.py builds it)."""
    cfg = qwen2_vl_config("7b", BF16)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    state = {s.name: make_tensor(s, BF16, generator, "cuda") for s in vision_tensor_specs(cfg["vision_config"], "")}
    with torch.device(CUDA):
        tower = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLConfig(**cfg).vision_config, dtype=BF16)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing)
    processor = Qwen2VLImageProcessor(image_mean=CLIP_MEAN, image_std=CLIP_STD)  # 896 px fits its max_pixels
    return Qwen2VLVisionModel(tower, processor, cache_salt="test")


class Checker:
    """Encodes a batch with the graphs and eagerly, and asserts the two are bit-equal."""

    def __init__(self, model, max_graphs: int) -> None:
        self.model = model
        self.graphs = TowerGraphs(model.tower_forward, model.tower_inputs, MAX_PATCHES, max_graphs)
        self.seed = 0

    def encode(self, sides: list[tuple[int, int]]) -> tuple:
        """Fresh pixels each call; returns the batch's key."""
        self.seed += 1
        images = [self.model.preprocess(_noise(w, h, self.seed * 10 + i)) for i, (w, h) in enumerate(sides)]
        self.model.graphs = None
        eager = self.model.encode(images)
        self.model.graphs = self.graphs
        try:
            graphed = self.model.encode(images)
        finally:
            self.model.graphs = None
        for e, g in zip(eager, graphed, strict=True):
            assert e.shape == g.shape and torch.equal(e, g), (sides, (e.float() - g.float()).abs().max())
        return tuple(im.grid_thw for im in images)

    def counts(self) -> tuple[int, int]:
        return self.graphs.captures, self.graphs.replays


def _lru_sequence(model) -> None:
    check = Checker(model, max_graphs=2)
    lone = check.encode(LONE)
    assert check.counts() == (0, 0)  # seen once: eager
    check.encode(LONE)
    assert check.counts() == (1, 0) and check.graphs.lru.keys() == [lone]  # second sighting: captured
    check.encode(LONE)  # other pixels, same key: a replay
    assert check.counts() == (1, 1)
    ragged = check.encode(RAGGED)
    check.encode(RAGGED)
    check.encode(LONE)  # the two graphs share the pool: each replays right after the other
    check.encode(RAGGED)
    assert check.counts() == (2, 3) and check.graphs.lru.keys() == [lone, ragged]
    uniform = check.encode(UNIFORM)
    check.encode(UNIFORM)  # a third graph: the least recently used (lone) is dropped
    assert check.counts() == (3, 3) and check.graphs.lru.keys() == [ragged, uniform]
    check.encode(LONE)  # dropped: eager, then captured again, then replayed
    check.encode(LONE)
    check.encode(LONE)
    assert check.counts() == (4, 4) and check.graphs.lru.keys() == [uniform, lone]
    check.encode(UNIFORM)
    assert check.counts() == (4, 5)
    for _ in range(3):
        check.encode(TOO_LARGE)  # over the budget: never captured
    assert check.counts() == (4, 5) and not check.graphs.disabled


def test_tiny_towers_replay_bit_equal(tiny_vision):
    _lru_sequence(tiny_vision)


def test_7b_shaped_qwen2_vl_tower_replays_bit_equal(vision_7b):
    """The real tower's shape (32 blocks, head dim 80: our split-head kernel): a lone 336 px image, then a batch of
    a 336 px and a 448 x 252 px image, each replayed with new pixels."""
    check = Checker(vision_7b, max_graphs=2)
    check.graphs.lru.max_patches = 4096
    for sides in ([(336, 336)], [(336, 336), (448, 252)]):
        for _ in range(3):
            check.encode(sides)
    assert check.counts() == (2, 2)


def test_start_up_captures_a_lone_336_px_image(tiny_vision):
    model = tiny_vision
    assert use_tower_graphs(model, CUDA, MAX_PATCHES)
    try:
        warm_up_tower(model, CUDA, 2, graphs=True)
        assert model.graphs.captures >= 1
        image = model.preprocess(_noise(336, 336, 7))
        model.encode([image])
        assert model.graphs.replays == 1
    finally:
        model.graphs = None
