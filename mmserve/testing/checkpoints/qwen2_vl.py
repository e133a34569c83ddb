"""Random-weight Qwen2-VL checkpoints in the published layout (`Qwen/Qwen2-VL-7B-Instruct`: flat config.json with
`rope_scaling` mrope, q/k/v bias, `visual.*` + `model.*` tensors, flat `preprocessor_config.json`), or in the
transformers-5 dialect (nested text_config, `model.language_model.*` / `model.visual.*`, `processor_config.json`)."""

from __future__ import annotations

import argparse
import os

import torch

from mmserve.testing.checkpoints.llama import llama_tensor_specs
from mmserve.testing.checkpoints.tokenizer import build_tokenizer
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

# The Qwen2 special tokens in their published order; the first sits at 151643 in the real vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

SHAPES = {
    # text: hidden, layers, heads, kv heads, intermediate, mrope section (sums to head_dim / 2); vision: depth, width,
    # heads; base_id: where the special tokens start (published: 151643); vocab: embedding rows.
    "tiny": dict(
        text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128),
        mrope_section=[2, 3, 3], vision=dict(depth=2, embed_dim=32, num_heads=2), base_id=512, vocab=544,
    ),
    "7b": dict(
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944),
        mrope_section=[16, 24, 24], vision=dict(depth=32, embed_dim=1280, num_heads=16), base_id=151643, vocab=152064,
    ),
    # Qwen2-VL-72B-Instruct's shape (~146 GB in bf16): written without weights, for --load_format dummy.
    "72b": dict(
        text=dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=29568),
        mrope_section=[16, 24, 24], vision=dict(depth=32, embed_dim=1280, num_heads=16), base_id=151643, vocab=152064,
    ),
}  # fmt: skip


def special_token_ids(base_id: int) -> dict[str, int]:
    return {tok: base_id + i for i, tok in enumerate(SPECIAL_TOKENS)}


def qwen2_vl_config(shape: str, dtype: torch.dtype) -> dict:
    """The flat config.json of the published checkpoints."""
    s = SHAPES[shape]
    ids = special_token_ids(s["base_id"])
    hidden = s["text"]["hidden_size"]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
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
        "max_position_embeddings": 32768,
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
            **s["vision"], "mlp_ratio": 4, "in_chans": 3, "hidden_size": hidden, "patch_size": 14,
            "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": s["mrope_section"]},
        "vocab_size": s["vocab"],
        **s["text"],
    }  # fmt: skip


def vision_tensor_specs(vc: dict, prefix: str) -> list[TensorSpec]:
    """The vision tower (Conv3d patch embed, LayerNorm blocks with fused qkv) and the 2x2 patch merger."""
    e, hidden, merged = vc["embed_dim"], vc["hidden_size"], vc["embed_dim"] * vc["spatial_merge_size"] ** 2
    patch_in = 3 * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    mlp = e * vc["mlp_ratio"]
    specs = [
        TensorSpec(f"{prefix}patch_embed.proj.weight", (e, 3, vc["temporal_patch_size"], 14, 14), linear_std(patch_in))
    ]
    for i in range(vc["depth"]):
        p = f"{prefix}blocks.{i}."
        specs += _layer_norm(p + "norm1", e) + _layer_norm(p + "norm2", e)
        specs += _linear(p + "attn.qkv", 3 * e, e) + _linear(p + "attn.proj", e, e)
        specs += _linear(p + "mlp.fc1", mlp, e) + _linear(p + "mlp.fc2", e, mlp)
    specs += _layer_norm(f"{prefix}merger.ln_q", e)
    specs += _linear(f"{prefix}merger.mlp.0", merged, merged) + _linear(f"{prefix}merger.mlp.2", hidden, merged)
    return specs


def _linear(name: str, out_features: int, in_features: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (out_features, in_features), linear_std(in_features)),
            TensorSpec(name + ".bias", (out_features,), 0.02)]  # fmt: skip


def _layer_norm(name: str, dim: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (dim,), 0.1, mean=1.0), TensorSpec(name + ".bias", (dim,), 0.02)]


def build_qwen2_vl_tokenizer(out_dir: str, base_id: int, extra_tokens: tuple[str, ...] = ()) -> None:
    """A small byte-level BPE with the Qwen2 special tokens from base_id on (reserved fillers below it), then
    `extra_tokens` as ordinary added tokens (a later generation's), eos `<|im_end|>`, no BOS: tokenizes
    `<|vision_start|><|image_pad|><|vision_end|>` to the config's ids."""
    fast = build_tokenizer(out_dir, add_bos=False)
    backend = fast.backend_tokenizer
    # One batched call: the 7B's specials sit past 151k ids and adding fillers one by one would be slow.
    backend.add_special_tokens([f"<|reserved_{i}|>" for i in range(backend.get_vocab_size(), base_id)])
    if backend.get_vocab_size() != base_id:
        raise ValueError(f"the base tokenizer already has {backend.get_vocab_size()} > {base_id} ids")
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    if extra_tokens:
        backend.add_tokens(list(extra_tokens))
    fast.eos_token = "<|im_end|>"
    fast.pad_token = "<|endoftext|>"
    fast.save_pretrained(out_dir)


def build_qwen2_vl(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    dialect: str = "published",
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 64,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
    weights: bool = True,
) -> str:
    """Write config, tokenizer, image processor config and random weights; returns out_dir. dialect "published"
    (flat config, `visual.*`) or "v5" (what transformers 5 saves). weights=False: every file but the weights, for
    serving with --load_format dummy."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = qwen2_vl_config(shape, dtype)
    build_qwen2_vl_tokenizer(out_dir, SHAPES[shape]["base_id"])
    from transformers import Qwen2VLConfig

    write_qwen_vl_layout(out_dir, cfg, Qwen2VLConfig, "Qwen2VLProcessor", vision_tensor_specs, dialect, min_pixels,
                         max_pixels, dtype, num_shards, seed, device, weights)  # fmt: skip
    return out_dir


def write_qwen_vl_layout(
    out_dir: str,
    cfg: dict,
    config_class: type,
    processor_class: str,
    vision_specs,
    dialect: str,
    min_pixels: int,
    max_pixels: int,
    dtype: torch.dtype,
    num_shards: int | None,
    seed: int,
    device: str,
    weights: bool = True,
) -> None:
    """Config, image processor config, generation config and random weights of a Qwen2-VL-style checkpoint (Qwen2-VL,
    Qwen2.5-VL) in `dialect`; `vision_specs(vision_config, prefix)` lists the tower's tensors."""
    image_processor = {
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
    }  # fmt: skip
    text_prefix, vision_prefix, lm_head = "model.", "visual.", "lm_head.weight"
    if dialect == "published":
        write_json(os.path.join(out_dir, "config.json"), cfg)
        write_json(
            os.path.join(out_dir, "preprocessor_config.json"),
            {**image_processor, "processor_class": processor_class},
        )
    elif dialect == "v5":
        config_class(**cfg).save_pretrained(out_dir)  # nested text_config, rope_parameters, dtype
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        nested = {k: v for k, v in image_processor.items() if not k.endswith("_pixels")}
        nested["size"] = size
        write_json(
            os.path.join(out_dir, "processor_config.json"),
            {"image_processor": nested, "processor_class": processor_class},
        )
        text_prefix, vision_prefix = "model.language_model.", "model.visual."
    else:
        raise ValueError(f"unknown dialect {dialect!r}")
    eos = cfg["eos_token_id"]
    write_json(
        os.path.join(out_dir, "generation_config.json"), {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}
    )
    if not weights:
        return
    specs = llama_tensor_specs(cfg, prefix=text_prefix, lm_head=lm_head, bias=True)
    specs += vision_specs(cfg["vision_config"], vision_prefix)
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed, device=device)


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Qwen2-VL checkpoint in the published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 7b, float32 for tiny")
    ap.add_argument("--dialect", choices=["published", "v5"], default="published")
    ap.add_argument("--max_pixels", type=int, default=None, help="default: 12845056 for 7b (published), 50176 tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no_weights", action="store_true", help="config, tokenizer and processor files only (for "
                    "--load_format dummy); the 72b shape is always written so")  # fmt: skip
    args = ap.parse_args()
    large = args.shape != "tiny"
    dtype = getattr(torch, args.dtype or ("bfloat16" if large else "float32"))
    max_pixels = args.max_pixels or (12845056 if large else 28 * 28 * 64)
    weights = not args.no_weights and args.shape != "72b"
    build_qwen2_vl(args.out, args.shape, dtype, args.dialect, max_pixels=max_pixels,
                   num_shards=None if large else 2, device=args.device, weights=weights)  # fmt: skip
    what = "checkpoint" if weights else "config, tokenizer and processor (no weights: serve with --load_format dummy)"
    print(f"wrote {args.shape} Qwen2-VL {what} ({args.dialect} layout) to {args.out}")


if __name__ == "__main__":
    main()
