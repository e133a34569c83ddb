"""Writing random weights to disk in the hub's sharded formats, one shard in memory at a time (7B-shaped checkpoints
are built this way on the GPU host)."""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    std: float = 0.0  # 0: ones (norm weights); < 0: zeros
    mean: float = 0.0


def linear_std(fan_in: int, gain: float = 1.0) -> float:
    """Keeps activations O(1) through random layers, so logits are decisive and greedy tokens are stable."""
    return gain / math.sqrt(fan_in)


def make_tensor(spec: TensorSpec, dtype: torch.dtype, generator: torch.Generator, device: str = "cpu") -> torch.Tensor:
    if spec.std == 0.0:
        return torch.ones(spec.shape, dtype=dtype, device=device)
    if spec.std < 0.0:
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    t = torch.empty(spec.shape, dtype=torch.float32, device=device)
    t.normal_(spec.mean, spec.std, generator=generator)
    return t.to(dtype)


def write_checkpoint(
    out_dir: str,
    specs: Iterable[TensorSpec],
    dtype: torch.dtype,
    fmt: str = "safetensors",
    max_shard_bytes: int = 2 << 30,
    num_shards: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> None:
    """Write `specs` as `model-0000N-of-0000M.safetensors` + index (fmt="safetensors") or
    `pytorch_model-0000N-of-0000M.bin` + index (fmt="bin"); a single shard drops the index as the hub does.
    num_shards, when given, splits the tensors evenly by count instead of by size."""
    specs = list(specs)
    generator = torch.Generator(device=device).manual_seed(seed)
    groups = _shard_groups(specs, dtype, max_shard_bytes, num_shards)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"{stem}.{ext}" if len(groups) == 1 else f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}"
        shard = {s.name: make_tensor(s, dtype, generator, device).cpu() for s in group}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        if fmt == "safetensors":
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        else:
            torch.save(shard, os.path.join(out_dir, fname))
        weight_map.update({name: fname for name in shard})
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out_dir, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _shard_groups(
    specs: list[TensorSpec], dtype: torch.dtype, max_shard_bytes: int, num_shards: int | None
) -> list[list[TensorSpec]]:
    if num_shards is not None:
        per = math.ceil(len(specs) / num_shards)
        return [specs[i : i + per] for i in range(0, len(specs), per)]
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    elem = torch.empty((), dtype=dtype).element_size()
    for s in specs:
        nbytes = math.prod(s.shape) * elem
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += nbytes
    return groups


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def read_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    return {name: tensor for path in paths for name, tensor in load_file(path).items()}
