"""Random-weight Qwen2.5-VL checkpoints in the published layout (`Qwen/Qwen2.5-VL-7B-Instruct`: flat config.json with
`rope_scaling` mrope and a `vision_config` holding `window_size`, `fullatt_block_indexes`, `out_hidden_size`; q/k/v
bias; `visual.*` + `model.*` + `lm_head.*` tensors; flat `preprocessor_config.json`; the Instruct chat template in
tokenizer_config.json and chat_template.json), or in the transformers-5 dialect (nested text_config,
`model.language_model.*` / `model.visual.*`, `processor_config.json`).

The tower differs from Qwen2-VL's: RMSNorm (weight only) instead of LayerNorm, a SwiGLU MLP with bias
(`mlp.{gate,up,down}_proj`), window attention except in the `fullatt_block_indexes` blocks, an RMSNorm `merger.ln_q`,
and a merger projecting to `out_hidden_size` (the LLM width; `hidden_size` is the tower's own width)."""

from __future__ import annotations

import argparse
import os

import torch

from mmserve.testing.checkpoints.qwen2_vl import SPECIAL_TOKENS, _linear, build_qwen2_vl_tokenizer, write_qwen_vl_layout
from mmserve.testing.checkpoints.qwen2_vl_demo import CHAT_TEMPLATE, add_chat_template
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std

# Qwen2.5's tokenizer adds these after Qwen2-VL's specials (151657 on), as ordinary (non-special) added tokens.
EXTRA_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip

# The Instruct checkpoints ship the same chat template as Qwen2-VL-*-Instruct (a default system turn, one vision block
# per image part), in tokenizer_config.json and chat_template.json.
QWEN2_5_VL_CHAT_TEMPLATE = CHAT_TEMPLATE

SHAPES = {
    # text: hidden, layers, heads, kv heads, intermediate, mrope section (sums to head_dim / 2); vision: depth, width
    # (hidden_size), heads, SwiGLU width, window (pixels), full-attention blocks; base_id: where the special tokens
    # start (published: 151643); vocab: embedding rows.
    "tiny": dict(
        text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128),
        mrope_section=[2, 3, 3],
        # window 56 px = 2x2 merged tokens: images of a few hundred pixels span several windows.
        vision=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=56, window_size=56,
                    fullatt_block_indexes=[1]),
        base_id=512, vocab=544,
    ),
    "7b": dict(
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944),
        mrope_section=[16, 24, 24],
        vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31]),
        base_id=151643, vocab=152064,
    ),
}  # fmt: skip


def special_token_ids(base_id: int) -> dict[str, int]:
    return {tok: base_id + i for i, tok in enumerate(SPECIAL_TOKENS + EXTRA_TOKENS)}


def qwen2_5_vl_config(shape: str, dtype: torch.dtype) -> dict:
    """The flat config.json of the published checkpoints."""
    s = SHAPES[shape]
    ids = special_token_ids(s["base_id"])
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 128000,
        "max_window_layers": s["text"]["num_hidden_layers"],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            **s["vision"], "hidden_act": "silu", "in_chans": 3, "out_hidden_size": s["text"]["hidden_size"],
            "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": s["mrope_section"]},
        "vocab_size": s["vocab"],
        **s["text"],
    }  # fmt: skip


def vision_tensor_specs(vc: dict, prefix: str) -> list[TensorSpec]:
    """The tower (Conv3d patch embed without bias; RMSNorm blocks with fused qkv and a SwiGLU MLP, all linears with
    bias) and the 2x2 patch merger (RMSNorm, Linear, GELU, Linear to out_hidden_size)."""
    e, inter, out = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"]
    merged = e * vc["spatial_merge_size"] ** 2
    t, p = vc["temporal_patch_size"], vc["patch_size"]
    specs = [TensorSpec(f"{prefix}patch_embed.proj.weight", (e, 3, t, p, p), linear_std(3 * t * p * p))]
    for i in range(vc["depth"]):
        b = f"{prefix}blocks.{i}."
        specs += [_rms_norm(b + "norm1", e), _rms_norm(b + "norm2", e)]
        specs += _linear(b + "attn.qkv", 3 * e, e) + _linear(b + "attn.proj", e, e)
        specs += _linear(b + "mlp.gate_proj", inter, e) + _linear(b + "mlp.up_proj", inter, e)
        specs += _linear(b + "mlp.down_proj", e, inter)
    specs += [_rms_norm(f"{prefix}merger.ln_q", e)]
    specs += _linear(f"{prefix}merger.mlp.0", merged, merged) + _linear(f"{prefix}merger.mlp.2", out, merged)
    return specs


def _rms_norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(name + ".weight", (dim,), 0.1, mean=1.0)


def build_qwen2_5_vl(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    dialect: str = "published",
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 64,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """Write config, tokenizer (with the chat template), image processor config and random weights; returns out_dir.
    dialect "published" (flat config, `visual.*`, `model.*`) or "v5" (what transformers 5 saves)."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = qwen2_5_vl_config(shape, dtype)
    build_qwen2_vl_tokenizer(out_dir, SHAPES[shape]["base_id"], EXTRA_TOKENS)
    add_chat_template(out_dir, QWEN2_5_VL_CHAT_TEMPLATE)
    from transformers import Qwen2_5_VLConfig

    write_qwen_vl_layout(out_dir, cfg, Qwen2_5_VLConfig, "Qwen2_5_VLProcessor", vision_tensor_specs, dialect,
                         min_pixels, max_pixels, dtype, num_shards, seed, device)  # fmt: skip
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Qwen2.5-VL checkpoint in the published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 7b, float32 for tiny")
    ap.add_argument("--dialect", choices=["published", "v5"], default="published")
    ap.add_argument("--max_pixels", type=int, default=None, help="default: 12845056 for 7b (published), 50176 tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.shape == "7b" else "float32"))
    max_pixels = args.max_pixels or (12845056 if args.shape == "7b" else 28 * 28 * 64)
    build_qwen2_5_vl(args.out, args.shape, dtype, args.dialect, max_pixels=max_pixels,
                     num_shards=None if args.shape == "7b" else 2, device=args.device)  # fmt: skip
    print(f"wrote {args.shape} Qwen2.5-VL checkpoint ({args.dialect} layout) to {args.out}")


if __name__ == "__main__":
    main()
