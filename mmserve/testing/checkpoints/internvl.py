"""Random-weight InternVL checkpoints in the transformers-native layout of the `-hf` repositories
(`OpenGVLab/InternVL3-8B-hf`): `InternVLForConditionalGeneration` with a Qwen2 `text_config` and an InternViT
`vision_config`; tensors `model.language_model.*` + `model.vision_tower.*` + `model.multi_modal_projector.*` +
`lm_head.weight` (or the older `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`,
`language_model.lm_head.weight`); the Qwen2.5 tokenizer with InternVL's `<img>`, `</img>`, `<IMG_CONTEXT>` (its
`extra_special_tokens` name them, as InternVLProcessor reads them); `preprocessor_config.json` (GotOcr2 image
processor, 448 px tiles, `min_patches`/`max_patches`), `processor_config.json` (`image_seq_length`) and the
published chat template in `chat_template.json` and tokenizer_config.json.

    python -m mmserve.testing.checkpoints.internvl --out DIR --shape 8b    # InternVL3-8B-hf shapes, bf16
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mmserve.prep.chat_templates import INTERNVL
from mmserve.testing.checkpoints.llama import llama_tensor_specs
from mmserve.testing.checkpoints.qwen2_5_vl import EXTRA_TOKENS as QWEN2_5_EXTRA_TOKENS
from mmserve.testing.checkpoints.qwen2_vl import SPECIAL_TOKENS, build_qwen2_vl_tokenizer
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# InternVL's tokens, added after Qwen2.5's (151665 on in the published vocabulary: <IMG_CONTEXT> is 151667)
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
VIDEO_TOKEN = "<video>"

SHAPES = {
    # text: the Qwen2 decoder; vision: InternViT (tile = image_size px, patch_size px patches, 2x2 pixel shuffle);
    # base_id: where Qwen2's special tokens start (published: 151643); vocab: embedding rows.
    "tiny": dict(
        text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128),
        # 112 px tiles of 8x8 patches: 16 tokens a tile after the pixel shuffle
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=[112, 112], patch_size=[14, 14]),
        base_id=512, vocab=544,
    ),
    "8b": dict(
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=[448, 448], patch_size=[14, 14]),
        base_id=151643, vocab=151674,
    ),
}  # fmt: skip


def token_ids(base_id: int) -> dict[str, int]:
    names = SPECIAL_TOKENS + QWEN2_5_EXTRA_TOKENS + INTERNVL_TOKENS + (VIDEO_TOKEN,)
    return {tok: base_id + i for i, tok in enumerate(names)}


def image_seq_length(vision: dict, downsample_ratio: float = 0.5) -> int:
    """Tokens per tile: the tile's patches after the pixel shuffle."""
    return int((vision["image_size"][0] // vision["patch_size"][0]) ** 2 * downsample_ratio**2)


def internvl_config(shape: str, dtype: torch.dtype) -> dict:
    s = SHAPES[shape]
    ids = token_ids(s["base_id"])
    return {
        "architectures": ["InternVLForConditionalGeneration"],
        "downsample_ratio": 0.5,
        "image_seq_length": image_seq_length(s["vision"]),
        "image_token_id": ids["<IMG_CONTEXT>"],
        "model_type": "internvl",
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "max_window_layers": s["text"]["num_hidden_layers"],
            "model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "use_sliding_window": False, "vocab_size": s["vocab"], **s["text"],
        },
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.52.0.dev0",
        "vision_config": {
            "architectures": ["InternVisionModel"], "attention_bias": True, "attention_dropout": 0.0,
            "dropout": 0.0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "initializer_factor": 0.1,
            "initializer_range": 1e-10, "layer_norm_eps": 1e-06, "layer_scale_init_value": 0.1,
            "model_type": "internvl_vision", "norm_type": "layer_norm", "num_channels": 3, "projection_dropout": 0.0,
            "torch_dtype": "bfloat16", "use_absolute_position_embeddings": True, "use_mask_token": False,
            "use_mean_pooling": True, "use_qk_norm": False, **s["vision"],
        },
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
    }  # fmt: skip


def _linear(name: str, out_f: int, in_f: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (out_f, in_f), linear_std(in_f)), TensorSpec(name + ".bias", (out_f,), 0.02)]


def _layer_norm(name: str, dim: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (dim,), 0.1, mean=1.0), TensorSpec(name + ".bias", (dim,), 0.02)]


def vision_tensor_specs(vision: dict, prefix: str) -> list[TensorSpec]:
    """InternViT as transformers' InternVLVisionModel names it (CLS token, absolute positions, layer-scaled blocks)."""
    h, inter, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"][0]
    positions = (vision["image_size"][0] // p) ** 2 + 1
    specs = [
        TensorSpec(prefix + "embeddings.cls_token", (1, 1, h), 0.5),
        TensorSpec(prefix + "embeddings.position_embeddings", (1, positions, h), 0.5),
        *_linear(prefix + "embeddings.patch_embeddings.projection", h, 3 * p * p),
    ]
    specs[2] = TensorSpec(specs[2].name, (h, 3, p, p), linear_std(3 * p * p))  # a Conv2d kernel
    for i in range(vision["num_hidden_layers"]):
        layer = f"{prefix}encoder.layer.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "projection_layer"):
            specs += _linear(layer + "attention." + proj, h, h)
        specs += [TensorSpec(layer + "lambda_1", (h,), 0.1, mean=0.5), TensorSpec(layer + "lambda_2", (h,), 0.1, 0.5)]
        specs += _layer_norm(layer + "layernorm_before", h) + _layer_norm(layer + "layernorm_after", h)
        specs += _linear(layer + "mlp.fc1", inter, h) + _linear(layer + "mlp.fc2", h, inter)
    return specs


def projector_specs(prefix: str, vision_hidden: int, text_hidden: int) -> list[TensorSpec]:
    """LayerNorm over the 2x2-shuffled features, Linear, GELU, Linear."""
    shuffled = vision_hidden * 4
    return (
        _layer_norm(prefix + "layer_norm", shuffled)
        + _linear(prefix + "linear_1", text_hidden, shuffled)
        + _linear(prefix + "linear_2", text_hidden, text_hidden)
    )


def build_internvl_tokenizer(out_dir: str, base_id: int) -> None:
    """Qwen2.5's tokens (Qwen2-VL's specials, then its added tokens), InternVL's after them, and the names
    InternVLProcessor reads (`start_image_token`, ...) in tokenizer_config.json's `extra_special_tokens`."""
    build_qwen2_vl_tokenizer(out_dir, base_id, QWEN2_5_EXTRA_TOKENS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [*INTERNVL_TOKENS, VIDEO_TOKEN]})
    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                      "context_image_token": "<IMG_CONTEXT>", "video_token": VIDEO_TOKEN}  # fmt: skip
    config["chat_template"] = INTERNVL
    write_json(path, config)


def preprocessor_config(tile: int, max_patches: int = 12) -> dict:
    """GotOcr2's image processor as the -hf repositories publish it: crop_to_patches stays False here and
    InternVLProcessor turns it on for its images."""
    return {
        "crop_size": None, "crop_to_patches": False, "data_format": "channels_first", "default_to_square": True,
        "device": None, "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "image_mean": IMAGENET_MEAN, "image_processor_type": "GotOcr2ImageProcessorFast",
        "image_std": IMAGENET_STD, "input_data_format": None, "max_patches": max_patches, "min_patches": 1,
        "processor_class": "InternVLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "return_tensors": None, "size": {"height": tile, "width": tile},
    }  # fmt: skip


def build_internvl_hf(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    legacy_names: bool = False,
    max_patches: int = 12,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """The -hf layout; legacy_names: the tensor names of transformers before 4.52 (`language_model.model.*`)."""
    s = SHAPES[shape]
    os.makedirs(out_dir, exist_ok=True)
    cfg = internvl_config(shape, dtype)
    build_internvl_tokenizer(out_dir, s["base_id"])
    write_json(os.path.join(out_dir, "config.json"), cfg)
    ids = token_ids(s["base_id"])
    write_json(os.path.join(out_dir, "generation_config.json"),
               {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]})  # fmt: skip
    write_json(os.path.join(out_dir, "preprocessor_config.json"),
               preprocessor_config(s["vision"]["image_size"][0], max_patches))  # fmt: skip
    write_json(os.path.join(out_dir, "processor_config.json"),
               {"image_seq_length": cfg["image_seq_length"], "processor_class": "InternVLProcessor"})  # fmt: skip
    write_json(os.path.join(out_dir, "chat_template.json"), {"chat_template": INTERNVL})
    top = "" if legacy_names else "model."  # the tower and projector sit under `model.` since transformers 4.52
    lm = "language_model.model." if legacy_names else "model.language_model."
    head = "language_model.lm_head.weight" if legacy_names else "lm_head.weight"
    tower, proj = top + "vision_tower.", top + "multi_modal_projector."
    specs = llama_tensor_specs(cfg["text_config"], prefix=lm, lm_head=head, bias=True)
    specs += vision_tensor_specs(s["vision"], tower)
    specs += projector_specs(proj, s["vision"]["hidden_size"], s["text"]["hidden_size"])
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed, device=device)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight InternVL checkpoint in the -hf layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 8b, float32 for tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    large = args.shape != "tiny"
    dtype = getattr(torch, args.dtype or ("bfloat16" if large else "float32"))
    build_internvl_hf(args.out, args.shape, dtype, num_shards=None if large else 2, device=args.device)
    print(f"wrote {args.shape} InternVL (-hf layout) checkpoint to {args.out}")


if __name__ == "__main__":
    main()
