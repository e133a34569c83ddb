"""Reading a family's vision tensors out of a checkpoint folder without loading the rest (the LLM's shards are read
by the language process)."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

_FP8_BLOCK = 128  # rows and columns per weight scale of block-wise FP8 checkpoints (Qwen3-VL-*-FP8)


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
    return _dequantize_fp8_blocks(out)


def _dequantize_fp8_blocks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block-wise FP8 checkpoint's tower linears (`*.weight` e4m3 with `*.weight_scale_inv` per 128x128 block,
    where its quantization_config does not leave the tower out) back to fp32 weights, which the tower loads in its
    own dtype (`--vit_quant_type fp8w8a8` quantizes them again, per channel)."""
    for scale_name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        scale_inv = tensors.pop(scale_name).float()
        name = scale_name.removesuffix("_scale_inv")
        q = tensors[name]
        n, k = q.shape
        if scale_inv.shape != (-(-n // _FP8_BLOCK), -(-k // _FP8_BLOCK)):
            raise ValueError(f"{scale_name}: shape {tuple(scale_inv.shape)} is not {_FP8_BLOCK}x{_FP8_BLOCK} blocks")
        full = scale_inv.repeat_interleave(_FP8_BLOCK, 0).repeat_interleave(_FP8_BLOCK, 1)[:n, :k]
        tensors[name] = q.float() * full
    return tensors


def _match(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name.startswith(p)), None)


def load_module_state(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """module.load_state_dict(state), strictly; `what` names it in the errors (e.g. "Gemma 3 projector")."""
    if not state:
        raise ValueError(f"no {what} tensors found in the checkpoint")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what} weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
