"""Reading HF checkpoint folders: config.json and weights (safetensors or .bin pickles, single or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model folder")
    with open(path) as f:
        return json.load(f)


def architecture(raw_config: dict) -> str:
    archs = raw_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json names no architectures")
    return archs[0]


def weight_files(model_dir: str) -> list[str]:
    """The weight files of a folder, preferring safetensors; an index file picks the shards."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = os.path.join(model_dir, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(model_dir, s) for s in shards]
        if os.path.isfile(os.path.join(model_dir, single)):
            return [os.path.join(model_dir, single)]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        found = sorted(f for f in os.listdir(model_dir) if f.endswith(".bin") and f.startswith("pytorch_model"))
    if not found:
        raise FileNotFoundError(f"no safetensors or pytorch_model*.bin weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one shard in memory at a time."""
    for path in weight_files(model_dir):
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def checkpoint_dtype(raw_config: dict) -> torch.dtype:
    text = raw_config.get("text_config") or {}
    name = raw_config.get("torch_dtype") or raw_config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float16
