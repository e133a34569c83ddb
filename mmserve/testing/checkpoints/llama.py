"""Random-weight Llama checkpoints in the published HF layout (config dialect of transformers 4.3x-4.4x)."""

from __future__ import annotations

import argparse
import os

import torch

from mmserve.testing.checkpoints.tokenizer import build_tokenizer
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

SHAPES = {
    # hidden, layers, heads, kv_heads, intermediate
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),
    "7b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008
    ),
}


def llama_config(vocab_size: int, **shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.40.0",
        "use_cache": True,
        "vocab_size": vocab_size,
        **shape,
    }


def llama_tensor_specs(cfg: dict, prefix: str = "model.", lm_head: str = "lm_head.weight", bias: bool = False):
    """Tensor names and shapes of a Llama-family decoder (q/k/v bias for Qwen2)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    specs = [TensorSpec(f"{prefix}embed_tokens.weight", (vocab, h), 1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), 0.0),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * head_dim, h), linear_std(h)),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * head_dim, h), linear_std(h)),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * head_dim, h), linear_std(h)),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * head_dim), linear_std(heads * head_dim)),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), 0.0),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), linear_std(h)),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), linear_std(h)),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), linear_std(inter)),
        ]
        if bias:
            specs += [
                TensorSpec(p + "self_attn.q_proj.bias", (heads * head_dim,), 0.1),
                TensorSpec(p + "self_attn.k_proj.bias", (kv_heads * head_dim,), 0.1),
                TensorSpec(p + "self_attn.v_proj.bias", (kv_heads * head_dim,), 0.1),
            ]
    specs += [TensorSpec(f"{prefix}norm.weight", (h,), 0.0), TensorSpec(lm_head, (vocab, h), linear_std(h, 2.0))]
    return specs


def build_llama(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    num_shards: int | None = 2,
    fmt: str = "safetensors",
    seed: int = 0,
    device: str = "cpu",
    **overrides,
) -> str:
    """Write a Llama checkpoint with a locally trained tokenizer; returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    vocab = 32000 if shape == "7b" else len(tokenizer)
    cfg = llama_config(vocab, **{**SHAPES[shape], **overrides})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(os.path.join(out_dir, "config.json"), cfg)
    write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": 2})
    write_checkpoint(out_dir, llama_tensor_specs(cfg), dtype, fmt=fmt, num_shards=num_shards, seed=seed, device=device)
    return out_dir


def build_qwen2(out_dir: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """A tiny Qwen2 text checkpoint (Qwen2ForCausalLM: Llama's layout with q/k/v biases); returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    cfg = llama_config(len(tokenizer), **SHAPES["tiny"])
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", torch_dtype=str(dtype).removeprefix("torch."))
    write_json(os.path.join(out_dir, "config.json"), cfg)
    write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": 2})
    write_checkpoint(out_dir, llama_tensor_specs(cfg, bias=True), dtype, num_shards=None, seed=seed)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Llama checkpoint in the published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    build_llama(args.out, args.shape, getattr(torch, args.dtype), num_shards=None, device=args.device)
    print(f"wrote {args.shape} Llama checkpoint to {args.out}")


if __name__ == "__main__":
    main()
