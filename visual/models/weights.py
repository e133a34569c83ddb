"""Reading a family's vision tensors out of a checkpoint folder without loading the rest (the LLM's shards are read
by the language process)."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open


def _shard_files(model_dir: str) -> list[str]:
    """Safetensors shards if any, else torch .bin shards (the original LLaVA layout)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    return files or sorted(glob.glob(os.path.join(model_dir, "*.bin")))


def load_prefixed_tensors(model_dir: str, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose names start with one of `prefixes` (the first matching prefix is stripped); only those are
    read from safetensors shards, and .bin shards are memory-mapped."""
    out: dict[str, torch.Tensor] = {}
    for path in _shard_files(model_dir):
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if (prefix := _match(name, prefixes)) is not None:
                        out[name[len(prefix) :]] = f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name, tensor in state.items():
                if (prefix := _match(name, prefixes)) is not None:
                    out[name[len(prefix) :]] = tensor
    return out


def _match(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name.startswith(p)), None)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
