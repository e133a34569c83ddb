"""The tower's pause for the router's prompt steps (visual/prefill_yield.py, `--tower_yield_ms`): a real tiny tower on
CPU with the hooks on its blocks, and the router's flag raised and lowered through the real shared-memory segment."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from PIL import Image

from mmserve.checkpoints.llava import build_llava_hf
from mmserve.checkpoints.qwen2_5_vl import build_qwen2_5_vl
from mmserve.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.checkpoints.qwen3_vl import build_qwen3_vl
from mmserve.checkpoints.qwen_vl import build_qwen_vl
from visual.models.base import vision_model_class
from visual.models.weights import read_json
from visual.prefill_yield import PrefillYield, tower_blocks
from visual.shm_segments import new_prefix, unlink_all
from visual.tower_turn import TowerTurn


def _load(builder, out_dir: str):
    built = builder(out_dir)
    model_dir = built if isinstance(built, str) else out_dir
    architecture = read_json(f"{model_dir}/config.json")["architectures"][0]
    return vision_model_class(architecture).from_pretrained(model_dir, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "builder, block_class",
    [
        (build_llava_hf, "CLIPEncoderLayer"),
        (build_qwen2_vl, "Qwen2VLVisionBlock"),
        (build_qwen2_5_vl, "Qwen2_5_VLVisionBlock"),
        (build_qwen3_vl, "Qwen3VLVisionBlock"),  # not its DeepStack mergers
        (build_qwen_vl, "Block"),  # timm's, in a Sequential
    ],
)
def test_every_familys_blocks_are_found(tmp_path, builder, block_class):
    blocks = tower_blocks(_load(builder, str(tmp_path)))
    assert blocks is not None and len(blocks) >= 2
    assert {type(b).__name__ for b in blocks} == {block_class}


@pytest.fixture
def turns():
    prefix = new_prefix()
    visual, router = TowerTurn(prefix), TowerTurn(prefix)
    visual.create()
    yield visual, router
    visual.close()
    router.close()
    unlink_all(prefix)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return _load(build_qwen2_vl, str(tmp_path_factory.mktemp("q2vl")))


def _encode(model, seed: int = 0) -> torch.Tensor:
    pixels = torch.Generator().manual_seed(seed)
    image = Image.frombytes("RGB", (56, 84), torch.randint(0, 256, (56 * 84 * 3,), generator=pixels,
                                                          dtype=torch.uint8).numpy().tobytes())  # fmt: skip
    return model.encode([model.preprocess(image)])[0]


def test_the_routers_flag_reaches_the_visual_process(turns):
    visual, router = turns
    assert not visual.prefill_running()
    router.set_prefill(True)
    assert visual.prefill_running()
    assert 0.09 < visual.wait_for_prefill(0.1) < 0.5  # up all along: waits its limit
    threading.Timer(0.05, router.set_prefill, (False,)).start()
    assert 0.04 < visual.wait_for_prefill(5.0) < 1.0  # lowered: the wait ends
    assert not visual.prefill_running()
    assert visual.wait_for_prefill(5.0) < 0.01


def test_the_tower_pauses_between_blocks_up_to_its_limit_and_computes_the_same(qwen2_vl, turns):
    visual, router = turns
    alone = _encode(qwen2_vl)
    yielder = PrefillYield.for_model(qwen2_vl, visual, limit_s=0.15)
    assert yielder is not None
    try:
        yielder.start_batch()
        assert torch.equal(_encode(qwen2_vl), alone)
        assert yielder.waited_s == 0.0  # no prompt step: no pause
        router.set_prefill(True)  # and it stays up: the limit ends the pauses, over the whole batch
        yielder.start_batch()
        t0 = time.monotonic()
        assert torch.equal(_encode(qwen2_vl), alone)
        assert 0.15 <= yielder.waited_s < 0.3
        assert time.monotonic() - t0 >= 0.15
        yielder.start_batch()  # a new batch may wait again; here the prompt step ends 50 ms in
        threading.Timer(0.05, router.set_prefill, (False,)).start()
        assert torch.equal(_encode(qwen2_vl), alone)
        assert 0.04 < yielder.waited_s < 0.15
    finally:
        router.set_prefill(False)
        yielder.detach()
    router.set_prefill(True)
    yielder.start_batch()
    _encode(qwen2_vl)
    assert yielder.waited_s == 0.0  # detached: no hooks left on the blocks
