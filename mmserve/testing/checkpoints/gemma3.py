"""Random-weight Gemma 3 checkpoints in the layout google/gemma-3-*-it publish (`Gemma3ForConditionalGeneration`):
config.json with a `gemma3_text` text_config and a SigLIP `vision_config`; tensors `language_model.model.*` (the head
tied to the embeddings), `vision_tower.vision_model.*` and `multi_modal_projector.*` (`mm_input_projection_weight`,
`mm_soft_emb_norm`), or transformers 5's names (`--dialect v5`: `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`); a tokenizer with Gemma's turn and image tokens (`extra_special_tokens` names
`boi_token`, `eoi_token` and `image_token`, as Gemma3Processor reads them), `preprocessor_config.json`
(Gemma3ImageProcessor, pan-and-scan off), `processor_config.json` (`image_seq_length`) and the published chat
template in tokenizer_config.json and chat_template.json.

    python -m mmserve.testing.checkpoints.gemma3 --out DIR --shape 12b    # Gemma-3-12B shapes, bf16
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mmserve.prep.chat_templates import GEMMA3
from mmserve.testing.checkpoints.tokenizer import build_tokenizer
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<pad>")

_VISION_4B = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=896, patch_size=14)  # fmt: skip
_LINEAR_8 = {"factor": 8.0, "rope_type": "linear"}
SHAPES = {
    # text: the Gemma 3 decoder (layer_types from sliding_window_pattern 6: five local layers, then a global one);
    # vision: SigLIP (image_size px, patch_size px patches), pooled to mm_tokens_per_image; base_id: where Gemma's
    # special tokens start in this vocabulary; vocab: embedding rows.
    "tiny": dict(
        # 16 image tokens a block, a 16-token window: every mechanism runs at test sizes, and a block never exceeds
        # the window (where transformers versions differ on which of the two wins)
        text=dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, query_pre_attn_scalar=24, sliding_window=16, rope_scaling=_LINEAR_8),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                    patch_size=8),
        mm_tokens_per_image=16, base_id=512, vocab=520,
    ),
    "4b": dict(
        text=dict(hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                  intermediate_size=10240, query_pre_attn_scalar=256, sliding_window=1024, rope_scaling=_LINEAR_8),
        vision=_VISION_4B, mm_tokens_per_image=256, base_id=262144 - 8, vocab=262208,
    ),
    "12b": dict(
        text=dict(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                  intermediate_size=15360, query_pre_attn_scalar=256, sliding_window=1024, rope_scaling=_LINEAR_8),
        vision=_VISION_4B, mm_tokens_per_image=256, base_id=262144 - 8, vocab=262208,
    ),
    "27b": dict(
        text=dict(hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                  intermediate_size=21504, query_pre_attn_scalar=168, sliding_window=1024, rope_scaling=_LINEAR_8),
        vision=_VISION_4B, mm_tokens_per_image=256, base_id=262144 - 8, vocab=262208,
    ),
}  # fmt: skip


NEWLINE_RUNS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
EMBED_STD_GAIN = 0.2  # the token embeddings' std times sqrt(hidden): see text_tensor_specs


def token_ids(base_id: int) -> dict[str, int]:
    return {tok: base_id + i for i, tok in enumerate(GEMMA_TOKENS)}


def gemma3_config(shape: str, dtype: torch.dtype) -> dict:
    s = SHAPES[shape]
    ids = token_ids(s["base_id"])
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "eos_token_id": [2, ids["<end_of_turn>"]],
        "image_token_index": ids["<image_soft_token>"],
        "initializer_range": 0.02,
        "mm_tokens_per_image": s["mm_tokens_per_image"],
        "model_type": "gemma3",
        # this tokenizer's ids (Gemma's own are eos 1, bos 2, pad 0: the text config's defaults)
        "text_config": {
            "bos_token_id": 1,
            "eos_token_id": [2, ids["<end_of_turn>"]],
            "pad_token_id": ids["<pad>"],
            "model_type": "gemma3_text",
            "vocab_size": s["vocab"],
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "max_position_embeddings": 131072,
            "sliding_window_pattern": 6,
            **s["text"],
        },  # fmt: skip
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "vision_use_head": False,
            "layer_norm_eps": 1e-06,
            **s["vision"],
        },  # fmt: skip
    }


def _linear(name: str, out_f: int, in_f: int, bias: bool = True) -> list[TensorSpec]:
    specs = [TensorSpec(name + ".weight", (out_f, in_f), linear_std(in_f))]
    return specs + [TensorSpec(name + ".bias", (out_f,), 0.02)] if bias else specs


def text_tensor_specs(text: dict, prefix: str) -> list[TensorSpec]:
    """Gemma 3's decoder; norm weights near 0 (Gemma scales by 1 + weight); the head is the embeddings."""
    h, inter, d = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    # Embeddings small beside the layers' outputs (after the model's sqrt(hidden) scale): with the head tied, a token
    # whose embedding dominates the residual stream scores highest against itself, and greedy decoding would repeat
    # the prompt's last token (10x larger embeddings gave one token 16 times over in every test prompt).
    specs = [TensorSpec(prefix + "embed_tokens.weight", (text["vocab_size"], h), EMBED_STD_GAIN / h**0.5)]
    for i in range(text["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            specs.append(TensorSpec(p + norm + ".weight", (h,), 0.1))
        specs += _linear(p + "self_attn.q_proj", heads * d, h, bias=False)
        specs += _linear(p + "self_attn.k_proj", kv * d, h, bias=False)
        specs += _linear(p + "self_attn.v_proj", kv * d, h, bias=False)
        specs += _linear(p + "self_attn.o_proj", h, heads * d, bias=False)
        specs += [
            TensorSpec(p + "self_attn.q_norm.weight", (d,), 0.1),
            TensorSpec(p + "self_attn.k_norm.weight", (d,), 0.1),
        ]
        specs += _linear(p + "mlp.gate_proj", inter, h, bias=False) + _linear(p + "mlp.up_proj", inter, h, bias=False)
        specs += _linear(p + "mlp.down_proj", h, inter, bias=False)
    return specs + [TensorSpec(prefix + "norm.weight", (h,), 0.1)]


def vision_tensor_specs(vision: dict, prefix: str) -> list[TensorSpec]:
    """SigLIP's vision transformer as transformers' SiglipVisionModel names it (no pooling head)."""
    h, inter, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    patches = (vision["image_size"] // p) ** 2
    specs = [
        TensorSpec(prefix + "embeddings.patch_embedding.weight", (h, 3, p, p), linear_std(3 * p * p)),
        TensorSpec(prefix + "embeddings.patch_embedding.bias", (h,), 0.02),
        TensorSpec(prefix + "embeddings.position_embedding.weight", (patches, h), 0.5),
    ]
    for i in range(vision["num_hidden_layers"]):
        layer = f"{prefix}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += _linear(layer + "self_attn." + proj, h, h)
        for norm in ("layer_norm1", "layer_norm2"):
            specs += [
                TensorSpec(layer + norm + ".weight", (h,), 0.1, 1.0),
                TensorSpec(layer + norm + ".bias", (h,), 0.02),
            ]
        specs += _linear(layer + "mlp.fc1", inter, h) + _linear(layer + "mlp.fc2", h, inter)
    return specs + [TensorSpec(prefix + "post_layernorm.weight", (h,), 0.1, 1.0),
                    TensorSpec(prefix + "post_layernorm.bias", (h,), 0.02)]  # fmt: skip


def projector_specs(prefix: str, vision_hidden: int, text_hidden: int) -> list[TensorSpec]:
    """Gemma3MultiModalProjector: the soft-embedding norm (Gemma's, 1 + weight) and the projection matrix."""
    return [
        TensorSpec(prefix + "mm_soft_emb_norm.weight", (vision_hidden,), 0.1),
        TensorSpec(prefix + "mm_input_projection_weight", (vision_hidden, text_hidden), linear_std(vision_hidden)),
    ]


def build_gemma3_tokenizer(out_dir: str, base_id: int) -> None:
    """A byte-level BPE with <bos>/<eos>, Gemma's turn and image tokens at `base_id`..., the names Gemma3Processor
    reads in tokenizer_config.json's `extra_special_tokens`, and the published chat template."""
    # Gemma's vocabulary holds runs of one to four newlines as single tokens, which vLLM's Gemma 3 processor looks up
    newlines = {base_id - len(NEWLINE_RUNS) + i: run for i, run in enumerate(NEWLINE_RUNS)}
    specials = {i: t for t, i in token_ids(base_id).items()}
    build_tokenizer(out_dir, vocab_size=min(base_id - len(NEWLINE_RUNS), 512), bos_token="<bos>", eos_token="<eos>",
                    extra_special_tokens=specials, added_tokens=newlines)  # fmt: skip
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"}  # fmt: skip
    config.update(pad_token="<pad>", chat_template=GEMMA3, processor_class="Gemma3Processor")
    write_json(path, config)


def preprocessor_config(image_size: int, image_seq_length: int) -> dict:
    """Gemma3ImageProcessor as google/gemma-3-*-it publish it: pan-and-scan unset (off)."""
    return {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": image_seq_length, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
        "size": {"height": image_size, "width": image_size},
    }  # fmt: skip


def build_gemma3(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    dialect: str = "published",
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
    tied_head: bool = True,
) -> str:
    """dialect "published": google's tensor names (`language_model.model.*`); "v5": transformers 5's.
    tied_head False: a head of its own (`lm_head.weight`), unlike the published checkpoints: with the head tied,
    embeddings scaled up for margins (tests/models/test_fp8_families.py) dominate the logits, and the greedy tokens
    repeat the prompt's last one."""
    s = SHAPES[shape]
    os.makedirs(out_dir, exist_ok=True)
    cfg = gemma3_config(shape, dtype)
    if not tied_head:
        cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = False
    build_gemma3_tokenizer(out_dir, s["base_id"])
    write_json(os.path.join(out_dir, "config.json"), cfg)
    pad = token_ids(s["base_id"])["<pad>"]
    write_json(os.path.join(out_dir, "generation_config.json"),
               {"bos_token_id": 1, "eos_token_id": cfg["eos_token_id"], "pad_token_id": pad, "do_sample": True,
                "top_k": 64, "top_p": 0.95})  # fmt: skip
    seq = s["mm_tokens_per_image"]
    write_json(os.path.join(out_dir, "preprocessor_config.json"), preprocessor_config(s["vision"]["image_size"], seq))
    write_json(os.path.join(out_dir, "processor_config.json"),
               {"image_seq_length": seq, "processor_class": "Gemma3Processor"})  # fmt: skip
    write_json(os.path.join(out_dir, "chat_template.json"), {"chat_template": GEMMA3})
    top = "model." if dialect == "v5" else ""
    lm = "model.language_model." if dialect == "v5" else "language_model.model."
    specs = text_tensor_specs(cfg["text_config"], lm)
    specs += vision_tensor_specs(s["vision"], top + "vision_tower.vision_model.")
    specs += projector_specs(top + "multi_modal_projector.", s["vision"]["hidden_size"], s["text"]["hidden_size"])
    if not tied_head:
        h = s["text"]["hidden_size"]
        specs.append(TensorSpec("lm_head.weight", (s["vocab"], h), linear_std(h, 2.0)))
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed, device=device)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight Gemma 3 checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dialect", choices=["published", "v5"], default="published")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 4b/12b/27b, float32 for tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    large = args.shape != "tiny"
    dtype = getattr(torch, args.dtype or ("bfloat16" if large else "float32"))
    build_gemma3(args.out, args.shape, dtype, args.dialect, num_shards=None if large else 2, device=args.device)
    print(f"wrote {args.shape} Gemma 3 checkpoint to {args.out}")


if __name__ == "__main__":
    main()
