"""Random-weight LLaVA-1.5 checkpoints in both published layouts.

- llava-hf (`llava-hf/llava-1.5-7b-hf`): `LlavaForConditionalGeneration`, sparse `text_config`, image token right
  after the tokenizer's vocabulary (32000) and `<pad>` after it, embeddings padded to a multiple of 64 (32064);
  sharded safetensors + index; `preprocessor_config.json` (CLIPImageProcessor); the published `chat_template.json`.
  Tensor names of the older uploads (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) or of
  transformers >= 4.52
  (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`), and optionally the
  transformers-5 nested `processor_config.json` instead of `preprocessor_config.json`.
- original (`liuhaotian/llava-v1.5-7b`): `LlavaLlamaForCausalLM` with Llama fields at the top level and `mm_*` keys,
  `pytorch_model-0000N-of-0000M.bin` shards with `model.mm_projector.{0,2}`, and the CLIP tower in a separate folder
  (a `CLIPVisionModel` checkpoint + its preprocessor config) that `mm_vision_tower` names.

    python -m mmserve.testing.checkpoints.llava --out DIR --shape 7b     # LLaVA-1.5-7B shapes, fp16, on the GPU if any
"""

from __future__ import annotations

import argparse
import os

import torch

from mmserve.prep.chat_templates import LLAVA_SYSTEM_PROMPT
from mmserve.testing.checkpoints.llama import SHAPES as LLAMA_SHAPES
from mmserve.testing.checkpoints.llama import llama_config, llama_tensor_specs
from mmserve.testing.checkpoints.tokenizer import build_tokenizer
from mmserve.testing.checkpoints.writer import TensorSpec, linear_std, write_checkpoint, write_json

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

SHAPES = {
    # text: Llama decoder; vision: CLIP ViT; base_vocab: ids of the text tokenizer (32000 published), after which
    # come <image> and <pad>; vocab: embedding rows of the llava-hf layout (32064 published).
    "tiny": dict(
        text=LLAMA_SHAPES["tiny"],
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                    patch_size=14),
        base_vocab=512, vocab=576,
    ),
    "7b": dict(
        text=LLAMA_SHAPES["7b"],
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14),
        base_vocab=32000, vocab=32064,
    ),
}  # fmt: skip

SYSTEM_PROMPT = LLAVA_SYSTEM_PROMPT  # LLaVA-1.5's conv_vicuna_v1 system prompt

# The chat template llava-hf/llava-1.5-7b-hf publishes in chat_template.json (the processor's; since its commit
# "Update chat_template.json to incorporate `generation` tag (#29)"): `USER: <image>\n<text> ASSISTANT:`, no system
# prompt, a message's images first. The file is this dict written with indent 2 and no final newline (700 bytes).
LLAVA_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def clip_vision_config(vision: dict, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["CLIPVisionModel"],
        "model_type": "clip_vision_model",
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "hidden_act": "quick_gelu",
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-05,
        "num_channels": 3,
        "projection_dim": 768,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.31.0",
        **vision,
    }


def clip_preprocessor_config(image_size: int, processor_class: str | None = None) -> dict:
    cfg = {
        "crop_size": {"height": image_size, "width": image_size},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": CLIP_STD,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": image_size},
    }
    if processor_class:
        cfg["processor_class"] = processor_class
    return cfg


def _norm(name: str, width: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (width,), 0.1, 1.0), TensorSpec(name + ".bias", (width,), 0.1)]


def _linear(name: str, out_f: int, in_f: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".weight", (out_f, in_f), linear_std(in_f)), TensorSpec(name + ".bias", (out_f,), 0.02)]


def clip_vision_tensor_specs(vision: dict, prefix: str) -> list[TensorSpec]:
    """CLIPVisionModel tensors as published (`<prefix>vision_model.*`)."""
    h, inter, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    positions = (vision["image_size"] // p) ** 2 + 1
    v = prefix + "vision_model."
    specs = [
        TensorSpec(v + "embeddings.class_embedding", (h,), 0.5),
        TensorSpec(v + "embeddings.patch_embedding.weight", (h, 3, p, p), linear_std(3 * p * p)),
        TensorSpec(v + "embeddings.position_embedding.weight", (positions, h), 0.5),
        *_norm(v + "pre_layrnorm", h),
    ]
    for i in range(vision["num_hidden_layers"]):
        layer = f"{v}encoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            specs += _linear(layer + "self_attn." + proj, h, h)
        specs += _norm(layer + "layer_norm1", h)
        specs += _linear(layer + "mlp.fc1", inter, h) + _linear(layer + "mlp.fc2", h, inter)
        specs += _norm(layer + "layer_norm2", h)
    return specs + _norm(v + "post_layernorm", h)


def projector_specs(linear_1: str, linear_2: str, vision_hidden: int, text_hidden: int) -> list[TensorSpec]:
    return _linear(linear_1, text_hidden, vision_hidden) + _linear(linear_2, text_hidden, text_hidden)


def build_llava_hf(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    new_names: bool = False,
    nested_processor_config: bool = False,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """llava-hf layout. new_names: transformers >= 4.52 tensor names; nested_processor_config: transformers 5's
    `processor_config.json` with a nested `image_processor` instead of `preprocessor_config.json`."""
    s = SHAPES[shape]
    os.makedirs(out_dir, exist_ok=True)
    image_id, pad_id = s["base_vocab"], s["base_vocab"] + 1
    build_tokenizer(out_dir, vocab_size=512, extra_special_tokens={image_id: "<image>", pad_id: "<pad>"})
    text = {**s["text"]}
    cfg = {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": image_id,
        "model_type": "llava",
        "pad_token_id": pad_id,
        "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5",
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": s["vocab"],
            # The published 7B config leaves these to LlamaConfig's defaults (which are the 7B shapes).
            **({} if shape == "7b" else text),
        },
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.36.0.dev0",
        "vision_config": {k: v for k, v in clip_vision_config(s["vision"], dtype).items() if k in _HF_VISION_KEYS},
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": s["vocab"],
    }
    cfg["vision_config"]["model_type"] = "clip_vision_model"
    write_json(os.path.join(out_dir, "config.json"), cfg)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": pad_id}
    write_json(os.path.join(out_dir, "generation_config.json"), generation)
    image_cfg = clip_preprocessor_config(s["vision"]["image_size"], "LlavaProcessor")
    # As on the hub since late 2024: LlavaProcessor expands <image> to patches + 1 (CLS) - 1 (dropped by "default").
    processor_extra = {
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": s["vision"]["patch_size"],
        "vision_feature_select_strategy": "default",
    }
    if nested_processor_config:
        write_json(
            os.path.join(out_dir, "processor_config.json"),
            {"image_processor": image_cfg, "processor_class": "LlavaProcessor", **processor_extra},
        )
    else:
        write_json(os.path.join(out_dir, "preprocessor_config.json"), image_cfg)
        processor = {"processor_class": "LlavaProcessor", **processor_extra}
        write_json(os.path.join(out_dir, "processor_config.json"), processor)
    write_json(os.path.join(out_dir, "chat_template.json"), {"chat_template": LLAVA_HF_CHAT_TEMPLATE})
    lm_cfg = llama_config(s["vocab"], **text)
    if new_names:
        lm = llama_tensor_specs(lm_cfg, prefix="model.language_model.", lm_head="lm_head.weight")
        tower, proj = "model.vision_tower.", "model.multi_modal_projector."
    else:
        lm = llama_tensor_specs(lm_cfg, prefix="language_model.model.", lm_head="language_model.lm_head.weight")
        tower, proj = "vision_tower.", "multi_modal_projector."
    specs = (
        lm
        + projector_specs(proj + "linear_1", proj + "linear_2", s["vision"]["hidden_size"], text["hidden_size"])
        + clip_vision_tensor_specs(s["vision"], tower)
    )
    write_checkpoint(out_dir, specs, dtype, num_shards=num_shards, seed=seed, device=device)
    return out_dir


# The fields the published llava-hf config spells out in its vision_config.
_HF_VISION_KEYS = {"hidden_size", "image_size", "intermediate_size", "model_type", "num_attention_heads",
                   "num_hidden_layers", "patch_size", "projection_dim", "vocab_size"}  # fmt: skip


def build_clip_tower(
    out_dir: str, shape: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 1, device: str = "cpu"
) -> str:
    """The separate CLIP folder of the original layout (what `mm_vision_tower` names)."""
    vision = SHAPES[shape]["vision"]
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "config.json"), clip_vision_config(vision, dtype))
    write_json(os.path.join(out_dir, "preprocessor_config.json"), clip_preprocessor_config(vision["image_size"]))
    write_checkpoint(out_dir, clip_vision_tensor_specs(vision, ""), dtype, num_shards=None, seed=seed, device=device)
    return out_dir


def build_llava_original(
    out_dir: str,
    clip_dir: str | None = None,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    num_shards: int | None = 2,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """liuhaotian layout; the CLIP tower goes to clip_dir (default: `<out_dir>-clip`), named by `mm_vision_tower`
    as an absolute local path (what users rewrite the hub name to)."""
    s = SHAPES[shape]
    clip_dir = os.path.abspath(clip_dir or out_dir.rstrip("/") + "-clip")
    build_clip_tower(clip_dir, shape, dtype, seed=seed + 1, device=device)
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=s["base_vocab"])
    text = s["text"]
    cfg = {
        **llama_config(s["base_vocab"], **text),
        "_name_or_path": "./checkpoints/llava-v1.5-7b",
        "architectures": ["LlavaLlamaForCausalLM"],
        "model_type": "llava",
        "freeze_mm_mlp_adapter": False,
        "image_aspect_ratio": "pad",
        "mm_hidden_size": s["vision"]["hidden_size"],
        "mm_projector_type": "mlp2x_gelu",
        "mm_use_im_patch_token": False,
        "mm_use_im_start_end": False,
        "mm_vision_select_feature": "patch",
        "mm_vision_select_layer": -2,
        "mm_vision_tower": clip_dir,
        "pad_token_id": 0,
        "pretraining_tp": 1,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.31.0",
        "tune_mm_mlp_adapter": False,
        "use_mm_proj": True,
    }
    write_json(os.path.join(out_dir, "config.json"), cfg)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    write_json(os.path.join(out_dir, "generation_config.json"), generation)
    specs = llama_tensor_specs(cfg) + projector_specs(
        "model.mm_projector.0", "model.mm_projector.2", s["vision"]["hidden_size"], text["hidden_size"]
    )
    write_checkpoint(out_dir, specs, dtype, fmt="bin", num_shards=num_shards, seed=seed, device=device)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight LLaVA-1.5 checkpoint in a published layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layout", choices=["llava-hf", "original"], default="llava-hf")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.layout == "llava-hf":
        build_llava_hf(args.out, args.shape, dtype, num_shards=None, device=args.device)
    else:
        build_llava_original(args.out, shape=args.shape, dtype=dtype, num_shards=None, device=args.device)
    print(f"wrote {args.shape} LLaVA-1.5 ({args.layout}) checkpoint to {args.out}")


if __name__ == "__main__":
    main()
