"""--visual_cuda_graph_max_patches: which vision-tower batches get a CUDA graph (`visual/tower_graphs.py`'s GraphLru:
captured on a key's second sighting, within the patch budget, at most max_graphs kept, least recently used dropped
first), the flag's default and checks, and graphs staying off on CPU. The graphs themselves, bit-equal to the eager
tower, are tested on a GPU: tests/models/test_tower_graphs_gpu.py."""

from __future__ import annotations

import shlex

import pytest
import torch

from mmserve.launch.cli import parse_config
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from visual.models.qwen2_vl import Qwen2VLVisionModel
from visual.options import VisualOptions
from visual.process import use_tower_graphs
from visual.tower_graphs import GraphLru

CPU = torch.device("cpu")
A, B, C = ((1, 24, 24),), ((1, 24, 24), (1, 18, 32)), ((1, 64, 64),)  # keys: the batches' grids


def test_a_key_is_captured_on_its_second_sighting_within_the_budget():
    lru: GraphLru[str] = GraphLru(max_patches=4096, max_graphs=2)
    assert not lru.sighted(A, 576)  # first sighting: eager
    assert lru.sighted(A, 576)  # second: capture
    assert not lru.sighted(B, 1152)
    assert not lru.sighted(C + C, 8192)  # over the budget: never captured
    assert not lru.sighted(C + C, 8192)
    assert not lru.sighted(C, 4096)
    assert lru.sighted(C, 4096)  # exactly the budget: captured on its second sighting
    assert lru.get(C) is None  # nothing was put for it yet


def test_lru_keeps_max_graphs_and_drops_the_least_recently_used():
    lru: GraphLru[str] = GraphLru(max_patches=4096, max_graphs=2)
    assert lru.put(A, "a") == [] and lru.put(B, "b") == []
    assert lru.get(A) == "a"  # A is now the most recently used
    assert lru.put(C, "c") == ["b"]
    assert lru.keys() == [A, C] and lru.get(B) is None and len(lru) == 2
    # a dropped key starts over: seen once (eager), then captured
    assert not lru.sighted(B, 1152) and lru.sighted(B, 1152)
    assert lru.put(B, "b2") == ["a"] and lru.keys() == [C, B]


def test_keys_seen_once_are_bounded():
    lru: GraphLru[str] = GraphLru(max_patches=4096, max_graphs=2, max_seen=2)
    for key in (A, B, C):
        assert not lru.sighted(key, 1)
    assert not lru.sighted(A, 1)  # A was forgotten when C came: seen once again
    assert lru.sighted(C, 1)


def test_flag_default_and_checks():
    assert VisualOptions().visual_cuda_graph_max_patches == 4096
    assert parse_config(shlex.split("--visual_cuda_graph_max_patches 0")).visual_cuda_graph_max_patches == 0
    with pytest.raises(ValueError, match="visual_cuda_graph_max_patches"):
        VisualOptions(visual_cuda_graph_max_patches=-1)


def test_graphs_stay_off_on_cpu(tmp_path):
    """On CPU the tower always runs eagerly, whatever the flag says (CUDA graphs are CUDA's)."""
    model = Qwen2VLVisionModel.from_pretrained(build_qwen2_vl(str(tmp_path / "q")), CPU, torch.float32)
    assert not use_tower_graphs(model, CPU, 4096)
    assert model.graphs is None
