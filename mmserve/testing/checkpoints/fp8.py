"""Published FP8 layouts of a written checkpoint, for tests and benchmarks: the decoder's linear weights rewritten in
place as

- block-wise FP8 (`block`: Qwen3-VL-*-Instruct-FP8, DeepSeek-V3's recipe): `<linear>.weight` float8_e4m3fn and
  `<linear>.weight_scale_inv` float32 [ceil(N / 128), ceil(K / 128)] (each 128x128 block's largest magnitude over
  448; the weight is its e4m3 values times that scale), with `quantization_config` {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [128, 128], modules_to_not_convert: [lm_head, the tower]};
- compressed-tensors FP8-dynamic (`channel`: llm-compressor's scheme): `<linear>.weight` float8_e4m3fn and
  `<linear>.weight_scale` [N, 1] in the checkpoint's dtype, with its `quantization_config` (quant_method:
  compressed-tensors, one config group of 8-bit float channel-wise weights and dynamic per-token activations).

The embeddings, lm_head, norms and the vision tower stay as written.

    python -m mmserve.testing.checkpoints.fp8 --dir /tmp/q3vl --format block
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = 128
FP8_MAX = 448.0
# The decoder's linear weights under every published prefix (model.layers., model.language_model.layers., ...)
_DECODER_LINEAR = re.compile(
    r"^(?!.*(visual|vision_tower)).*\blayers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$"
)


def quantize_block(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale_inv [ceil(N / block), ceil(K / block)] fp32): weight ~= e4m3 * its block's
    scale."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(weight.float(), (0, cols * block - k, 0, rows * block - n))
    tiles = padded.view(rows, block, cols, block)
    scales = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scales


def quantize_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale [N, 1] in the weight's dtype), as llm-compressor's FP8-dynamic writes it."""
    scales = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(weight.dtype)
    q = (weight.float() / scales.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The inverse of `quantize_block`, in fp32."""
    n, k = q.shape
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * full


def block_config() -> dict:
    return {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head", "model.visual", "visual"],
    }  # fmt: skip


def channel_config() -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*visual.*"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
    }  # fmt: skip


def quantize_checkpoint(model_dir: str, fmt: str = "block") -> str:
    """Rewrite `model_dir`'s safetensors shards (and index) with its decoder linears in FP8 (`fmt`: block or
    channel) and add the quantization_config to config.json; returns model_dir."""
    quantize, suffix, config = {
        "block": (quantize_block, "_scale_inv", block_config()),
        "channel": (quantize_channel, "_scale", channel_config()),
    }[fmt]
    renamed: dict[str, str] = {}  # new scale tensor -> its shard file
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for name in [n for n in tensors if _DECODER_LINEAR.match(n)]:
            tensors[name], tensors[name + suffix] = quantize(tensors[name])
            renamed[name + suffix] = os.path.basename(path)
        save_file(tensors, path, metadata={"format": "pt"})
    if not renamed:
        raise ValueError(f"{model_dir}: no decoder linear weights in safetensors shards")
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update(renamed)
        _write_json(index_path, index)
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw["quantization_config"] = config
    _write_json(config_path, raw)
    return model_dir


def scale_embeddings(model_dir: str, gain: float) -> str:
    """Multiply the token embeddings of `model_dir`'s shards by `gain`, in place; returns model_dir. Random weights
    give nearly flat logits, closer together than FP8's noise: with the embeddings scaled up, the residual stream
    carries each token's own embedding above the layers' contributions and greedy choices get margins, so that a
    quantized engine can be held to the unquantized reference (tests/models/test_fp8.py)."""
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for name in [n for n in tensors if n.endswith("embed_tokens.weight")]:
            tensors[name] = tensors[name] * gain
        save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description="Rewrite a checkpoint's decoder linear weights in a published FP8 layout")
    ap.add_argument("--dir", required=True, help="a checkpoint folder (rewritten in place)")
    ap.add_argument("--format", choices=["block", "channel"], default="block")
    ap.add_argument("--embed_gain", type=float, default=1.0, help="scale the token embeddings first (test margins)")
    args = ap.parse_args()
    if args.embed_gain != 1.0:
        scale_embeddings(args.dir, args.embed_gain)
    quantize_checkpoint(args.dir, args.format)
    print(f"{args.dir}: decoder linears rewritten as {args.format} FP8")


if __name__ == "__main__":
    main()
