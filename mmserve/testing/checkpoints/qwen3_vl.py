"""Random-weight Qwen3-VL (dense) checkpoints in the published layout (`Qwen/Qwen3-VL-8B-Instruct`: config.json with
nested `text_config` (Qwen3: q/k norm, no q/k/v bias, explicit head_dim, `rope_scaling` with interleaved mrope) and
`vision_config` (`deepstack_visual_indexes`, `num_position_embeddings`, `out_hidden_size`); tensors
`model.language_model.*`, `model.visual.*`, `lm_head.weight`; `preprocessor_config.json` with a `size` of
shortest/longest edge in pixels, 16 px patches and mean/std 0.5; the Instruct chat template in chat_template.json and
tokenizer_config.json), or in the transformers-5 dialect (`rope_parameters`, `processor_config.json`; same tensors).

The tower: a Conv3d patch embed with bias, a learned position table (`pos_embed`, interpolated to each grid), LayerNorm
blocks with a GELU MLP (`mlp.linear_fc1/2`), the 2x2 merger (`merger.norm` over one patch, `linear_fc1/2`), and one
DeepStack merger per `deepstack_visual_indexes` block (`deepstack_merger_list.j`, its norm over the merged patches).

    python -m mmserve.testing.checkpoints.qwen3_vl --out /tmp/q3vl        # tiny, for tests (CPU)
    python -m mmserve.testing.checkpoints.qwen3_vl --out /tmp/q3vl8b --shape 8b  # 8B-shaped, bf16, for benchmarks
    python -m mmserve.testing.checkpoints.qwen3_vl --out /tmp/q3vl --fp8 block  # as Qwen3-VL-*-Instruct-FP8
"""

from __future__ import annotations

import argparse
import os

import torch

from mmserve.prep.chat_templates import QWEN3_VL
from mmserve.testing.checkpoints.fp8 import quantize_checkpoint
from mmserve.testing.checkpoints.llama import llama_tensor_specs
from mmserve.testing.checkpoints.qwen2_5_vl import EXTRA_TOKENS as QWEN2_5_EXTRA_TOKENS
from mmserve.testing.checkpoints.qwen2_vl import SPECIAL_TOKENS, _layer_norm, _linear, build_qwen2_vl_tokenizer
from mmserve.testing.checkpoints.qwen2_vl_demo import add_chat_template
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

# Qwen3's tokenizer adds these after Qwen2.5's added tokens (151665 on), as ordinary (non-special) added tokens.
EXTRA_TOKENS = QWEN2_5_EXTRA_TOKENS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
HALF = [0.5, 0.5, 0.5]  # Qwen3-VL's image mean and std

SHAPES = {
    # text: Qwen3 decoder (head_dim explicit); mrope_section sums to head_dim / 2. vision: depth, width, heads, MLP
    # width, position table (a square), DeepStack blocks. base_id: where the special tokens start (published:
    # 151643); vocab: embedding rows.
    "tiny": dict(
        text=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=128),
        mrope_section=[6, 5, 5],
        # 12x12 position table: test images have grids on both sides of it. Two DeepStack blocks into an LLM of
        # three layers: the last layer gets none.
        vision=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=144,
                    deepstack_visual_indexes=[0, 2]),
        base_id=512, vocab=544,
    ),
    "8b": dict(
        text=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  intermediate_size=12288),
        mrope_section=[24, 20, 20],
        vision=dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24]),
        base_id=151643, vocab=151936,
    ),
}  # fmt: skip

# Published pixel bounds (256x256 .. 4096x4096); the tiny checkpoint keeps test images small.
PUBLISHED_MIN_PIXELS, PUBLISHED_MAX_PIXELS = 65536, 16777216
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64  # 4 .. 64 image tokens


def special_token_ids(base_id: int) -> dict[str, int]:
    return {tok: base_id + i for i, tok in enumerate(SPECIAL_TOKENS + EXTRA_TOKENS)}


def qwen3_vl_config(shape: str, dtype: torch.dtype) -> dict:
    """config.json as Qwen3-VL-*-Instruct publish it (written by transformers 4.57)."""
    s = SHAPES[shape]
    ids = special_token_ids(s["base_id"])
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": ids["<|endoftext|>"],
            "dtype": dtype_name, "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "rms_norm_eps": 1e-06,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": s["mrope_section"], "rope_type": "default"},
            "rope_theta": 5000000, "use_cache": True, "vocab_size": s["vocab"], **s["text"],
        },
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {
            **s["vision"], "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "initializer_range": 0.02,
            "model_type": "qwen3_vl", "out_hidden_size": s["text"]["hidden_size"], "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }  # fmt: skip


def text_tensor_specs(tc: dict, prefix: str) -> list[TensorSpec]:
    """The Qwen3 decoder: Llama's tensors (no bias) plus each layer's q_norm / k_norm [head_dim]."""
    specs = llama_tensor_specs(tc, prefix=prefix, lm_head="lm_head.weight")
    for i in range(tc["num_hidden_layers"]):
        p = f"{prefix}layers.{i}.self_attn."
        specs += [TensorSpec(p + name, (tc["head_dim"],), 0.1, mean=1.0) for name in ("q_norm.weight", "k_norm.weight")]
    return specs


def vision_tensor_specs(vc: dict, prefix: str) -> list[TensorSpec]:
    """The tower, its merger and its DeepStack mergers, named as Qwen3VLVisionModel's state dict."""
    e, inter, out = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"]
    merged = e * vc["spatial_merge_size"] ** 2
    t, p = vc["temporal_patch_size"], vc["patch_size"]
    specs = [
        TensorSpec(f"{prefix}patch_embed.proj.weight", (e, 3, t, p, p), linear_std(3 * t * p * p)),
        TensorSpec(f"{prefix}patch_embed.proj.bias", (e,), 0.02),
        TensorSpec(f"{prefix}pos_embed.weight", (vc["num_position_embeddings"], e), 0.5),
    ]
    for i in range(vc["depth"]):
        b = f"{prefix}blocks.{i}."
        specs += _layer_norm(b + "norm1", e) + _layer_norm(b + "norm2", e)
        specs += _linear(b + "attn.qkv", 3 * e, e) + _linear(b + "attn.proj", e, e)
        specs += _linear(b + "mlp.linear_fc1", inter, e) + _linear(b + "mlp.linear_fc2", e, inter)
    mergers = [(f"{prefix}merger.", e)]  # the main merger normalises each patch, the DeepStack ones the merged 2x2
    mergers += [(f"{prefix}deepstack_merger_list.{j}.", merged) for j in range(len(vc["deepstack_visual_indexes"]))]
    for m, norm_dim in mergers:
        specs += _layer_norm(m + "norm", norm_dim) + _linear(m + "linear_fc1", merged, merged)
        specs += _linear(m + "linear_fc2", out, merged)
    return specs


def image_processor_config(min_pixels: int, max_pixels: int) -> dict:
    return {
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": HALF, "image_std": HALF,
    }  # fmt: skip


def write_processor_configs(out_dir: str, dialect: str, min_pixels: int, max_pixels: int) -> None:
    """preprocessor_config.json and video_preprocessor_config.json as published, or transformers 5's
    processor_config.json (the image processor nested)."""
    image = image_processor_config(min_pixels, max_pixels)
    if dialect == "v5":
        write_json(
            os.path.join(out_dir, "processor_config.json"),
            {"image_processor": {**image, "image_processor_type": "Qwen2VLImageProcessor"},
             "processor_class": "Qwen3VLProcessor"},
        )  # fmt: skip
        return
    owner = {"processor_class": "Qwen3VLProcessor"}
    write_json(
        os.path.join(out_dir, "preprocessor_config.json"),
        {**image, **owner, "image_processor_type": "Qwen2VLImageProcessorFast"},
    )
    video = {**image, "size": {"longest_edge": 25165824, "shortest_edge": 4096}}
    write_json(
        os.path.join(out_dir, "video_preprocessor_config.json"),
        {**video, **owner, "video_processor_type": "Qwen3VLVideoProcessor"},
    )


def build_qwen3_vl(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    dialect: str = "published",
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """Write config, tokenizer (with the chat template), processor configs, generation config and random weights;
    returns out_dir. dialect "published" or "v5" (what transformers 5 saves)."""
    if dialect not in ("published", "v5"):
        raise ValueError(f"unknown dialect {dialect!r}")
    os.makedirs(out_dir, exist_ok=True)
    cfg = qwen3_vl_config(shape, dtype)
    build_qwen2_vl_tokenizer(out_dir, SHAPES[shape]["base_id"], EXTRA_TOKENS)
    add_chat_template(out_dir, QWEN3_VL)
    if dialect == "v5":
        from transformers import Qwen3VLConfig

        Qwen3VLConfig(**cfg).save_pretrained(out_dir)  # rope_parameters, dtype
    else:
        write_json(os.path.join(out_dir, "config.json"), cfg)
    write_processor_configs(out_dir, dialect, min_pixels, max_pixels)
    text = cfg["text_config"]
    eos = [text["eos_token_id"], text["bos_token_id"]]  # <|im_end|>, <|endoftext|>
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": text["bos_token_id"], "pad_token_id": text["bos_token_id"], "do_sample": True,
         "eos_token_id": eos, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.0, "temperature": 0.7},
    )  # fmt: skip
    specs = text_tensor_specs(text, "model.language_model.")
    specs += vision_tensor_specs(cfg["vision_config"], "model.visual.")
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed, device=device)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Qwen3-VL checkpoint in the published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 8b, float32 for tiny")
    ap.add_argument("--dialect", choices=["published", "v5"], default="published")
    ap.add_argument("--min_pixels", type=int, default=None, help="default: 65536 for 8b (published), 4096 tiny")
    ap.add_argument("--max_pixels", type=int, default=None, help="default: 16777216 for 8b (published), 65536 tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8", choices=["block", "channel"], default=None,
                    help="decoder linears in FP8: block = the Qwen3-VL-*-FP8 layout (128x128 weight_scale_inv), "
                    "channel = compressed-tensors FP8-dynamic")  # fmt: skip
    args = ap.parse_args()
    big = args.shape == "8b"
    dtype = getattr(torch, args.dtype or ("bfloat16" if big else "float32"))
    min_pixels = args.min_pixels or (PUBLISHED_MIN_PIXELS if big else TINY_MIN_PIXELS)
    max_pixels = args.max_pixels or (PUBLISHED_MAX_PIXELS if big else TINY_MAX_PIXELS)
    build_qwen3_vl(args.out, args.shape, dtype, args.dialect, min_pixels, max_pixels,
                   num_shards=None if big else 2, device=args.device)  # fmt: skip
    if args.fp8:
        quantize_checkpoint(args.out, args.fp8)
    print(f"wrote {args.shape} Qwen3-VL checkpoint ({args.dialect} layout{', FP8 ' + args.fp8 if args.fp8 else ''}) "
          f"to {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
