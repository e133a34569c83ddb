"""Random-weight Qwen-VL (v1) checkpoints in the published remote-code layout (`Qwen/Qwen-VL-Chat`): config.json
with `model_type: qwen` and a `visual` section, `QWenLMHeadModel` tensor names (`transformer.h.N.attn.c_attn`,
`mlp.w1/w2/c_proj`, `transformer.visual.*`), and a `qwen.tiktoken` vocabulary trained here (the special tokens
follow its ranks, as in the published tokenizer)."""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from safetensors.torch import load_file, save_file
from tiktoken._educational import bpe_train

from mmserve.prep.tokenizers.qwen_tiktoken import PAT_STR, SPECIAL_TOKENS, VOCAB_FILE, write_ranks
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

_CORPUS = (
    "You are a helpful assistant. Picture 1: What is in the picture? The picture shows a city by a river at night.\n"
    "Which two cities are shown in these pictures? Compare them. Chongqing and Beijing are large cities in China.\n"
    "Where are these two cities? Describe the image in detail. A cat is sitting on a red chair next to the window.\n"
    "The quick brown fox jumps over the lazy dog. 0123456789 北京 重庆 上海 你好 世界 café naïve 🙂\n"
)

SHAPES = {
    # The LLM width equals the resampler's (output_dim), whose heads are output_dim // 128.
    "tiny": dict(
        llm=dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, kv_channels=64, intermediate_size=512),
        visual=dict(heads=4, image_size=448, layers=2, mlp_ratio=4.9231, output_dim=256, patch_size=14, width=64),
        num_ranks=400,
    ),
}


def build_qwen_tiktoken(out_dir: str, num_ranks: int) -> dict[str, int]:
    """Train a byte-level BPE of num_ranks mergeable ranks on a small corpus, write qwen.tiktoken; returns the
    special token ids (numbered from num_ranks on)."""
    ranks = bpe_train(_CORPUS * 3, num_ranks, PAT_STR, visualise=None)
    write_ranks(os.path.join(out_dir, VOCAB_FILE), ranks)
    return {tok: len(ranks) + i for i, tok in enumerate(SPECIAL_TOKENS)}


def qwen_vl_config(shape: str, specials: dict[str, int], dtype: torch.dtype) -> dict:
    s = SHAPES[shape]
    vocab = math.ceil((max(specials.values()) + 1) / 64) * 64  # padded, as 151936 pads 151860
    return {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
        "attn_dropout_prob": 0.0,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "fp32": dtype == torch.float32,
        "emb_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-06,
        "max_position_embeddings": 8192,
        "model_type": "qwen",
        "no_bias": True,
        "onnx_safe": None,
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": 2048,
        "tie_word_embeddings": False,
        "tokenizer_type": "QWenTokenizer",
        "transformers_version": "4.31.0",
        "use_cache": True,
        "use_dynamic_ntk": True,
        "use_flash_attn": False,
        "use_logn_attn": True,
        "eos_token_id": specials["<|endoftext|>"],
        "visual": {**s["visual"], "image_start_id": specials["<img>"]},
        "vocab_size": vocab,
        **s["llm"],
    }


def llm_tensor_specs(cfg: dict) -> list[TensorSpec]:
    h, vocab, mlp = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"] // 2
    specs = [TensorSpec("transformer.wte.weight", (vocab, h), 1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        specs += [
            TensorSpec(p + "ln_1.weight", (h,), 0.1, mean=1.0),
            TensorSpec(p + "attn.c_attn.weight", (3 * h, h), linear_std(h)),  # fused [q; k; v]
            TensorSpec(p + "attn.c_attn.bias", (3 * h,), 0.1),
            TensorSpec(p + "attn.c_proj.weight", (h, h), linear_std(h)),
            TensorSpec(p + "ln_2.weight", (h,), 0.1, mean=1.0),
            TensorSpec(p + "mlp.w1.weight", (mlp, h), linear_std(h)),
            TensorSpec(p + "mlp.w2.weight", (mlp, h), linear_std(h)),
            TensorSpec(p + "mlp.c_proj.weight", (h, mlp), linear_std(mlp)),
        ]
    return specs + [
        TensorSpec("transformer.ln_f.weight", (h,), 0.1, mean=1.0),
        TensorSpec("lm_head.weight", (vocab, h), linear_std(h, 2.0)),
    ]


def visual_tensor_specs(v: dict, prefix: str = "transformer.visual.") -> list[TensorSpec]:
    w, out, mlp, p = v["width"], v["output_dim"], int(v["width"] * v["mlp_ratio"]), v["patch_size"]
    specs = [
        TensorSpec(prefix + "conv1.weight", (w, 3, p, p), linear_std(3 * p * p)),
        TensorSpec(prefix + "positional_embedding", (256, w), w**-0.5),  # a 16x16 table, resized to the grid
        *_layer_norm(prefix + "ln_pre", w),
    ]
    for i in range(v["layers"]):
        b = f"{prefix}transformer.resblocks.{i}."
        specs += _layer_norm(b + "ln_1", w) + _linear(b + "attn.in_proj", 3 * w, w) + _linear(b + "attn.out_proj", w, w)
        specs += _layer_norm(b + "ln_2", w) + _linear(b + "mlp.c_fc", mlp, w) + _linear(b + "mlp.c_proj", w, mlp)
    a = prefix + "attn_pool."
    specs += [
        TensorSpec(a + "query", (256, out), 0.02),
        TensorSpec(a + "pos_embed", (256, out), -1.0),  # overwritten with the 2-D sin-cos table
        TensorSpec(a + "kv_proj.weight", (out, w), linear_std(w)),
        TensorSpec(a + "attn.in_proj_weight", (3 * out, out), linear_std(out)),
        TensorSpec(a + "attn.in_proj_bias", (3 * out,), 0.02),
        *_linear(a + "attn.out_proj", out, out),
        *_layer_norm(a + "ln_q", out),
        *_layer_norm(a + "ln_kv", out),
        *_layer_norm(prefix + "ln_post", out),
        TensorSpec(prefix + "proj", (out, out), out**-0.5),
    ]
    return specs


def _linear(name: str, out_features: int, in_features: int) -> list[TensorSpec]:
    return [
        TensorSpec(name + ".weight", (out_features, in_features), linear_std(in_features)),
        TensorSpec(name + ".bias", (out_features,), 0.02),
    ]


def _layer_norm(name: str, dim: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (dim,), 0.1, mean=1.0), TensorSpec(name + ".bias", (dim,), 0.02)]


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """MAE's 2-D sin-cos table [grid*grid, dim], row-major: first half encodes the column, second half the row, each
    as [sin | cos] over dim/4 frequencies 1/10000^(k/(dim/4))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1).double() * omega  # [grid*grid, dim/4]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()


def _set_tensor(out_dir: str, name: str, value: torch.Tensor) -> None:
    index = os.path.join(out_dir, "model.safetensors.index.json")
    fname = json.load(open(index))["weight_map"][name] if os.path.exists(index) else "model.safetensors"
    path = os.path.join(out_dir, fname)
    shard = load_file(path)
    shard[name] = value.to(shard[name].dtype)
    save_file(shard, path, metadata={"format": "pt"})


def build_qwen_vl(
    out_dir: str, shape: str = "tiny", dtype: torch.dtype = torch.float32, num_shards: int | None = 2, seed: int = 0
) -> str:
    """Write config, generation config, tokenizer files and random weights; returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    specials = build_qwen_tiktoken(out_dir, SHAPES[shape]["num_ranks"])
    cfg = qwen_vl_config(shape, specials, dtype)
    write_json(os.path.join(out_dir, "config.json"), cfg)
    eod = specials["<|endoftext|>"]
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"chat_format": "chatml", "eos_token_id": eod, "pad_token_id": eod, "max_window_size": 6144},
    )
    write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "model_max_length": 8192,
            "tokenizer_class": "QWenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
        },
    )
    specs = llm_tensor_specs(cfg) + visual_tensor_specs(cfg["visual"])
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed)
    _set_tensor(out_dir, "transformer.visual.attn_pool.pos_embed", sincos_2d(cfg["visual"]["output_dim"], 16))
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Qwen-VL (v1) checkpoint in the published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    build_qwen_vl(args.out, args.shape, getattr(torch, args.dtype))
    print(f"wrote {args.shape} Qwen-VL checkpoint to {args.out}")


if __name__ == "__main__":
    main()
