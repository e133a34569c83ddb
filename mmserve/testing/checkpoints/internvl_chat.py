"""Random-weight InternVL checkpoints in the remote-code layout as published (`OpenGVLab/InternVL3-8B`:
`InternVLChatModel`, config.json with `llm_config` (Qwen2), `vision_config` (`intern_vit_6b`), `force_image_size`,
`min_dynamic_patch` / `max_dynamic_patch`, `use_thumbnail`, `ps_version` v2; tensors `vision_model.*` with a fused
`attn.qkv` and layer scales `ls1` / `ls2`, the projector `mlp1.{0,1,3}`, `language_model.model.*` +
`language_model.lm_head.weight`), with no processor files and no chat template (the family's built-in one serves it).

transformers has no class for this layout without the remote code, so the builder writes the same weights in the
-hf layout too (`<out_dir>-hf`): HF's InternVLForConditionalGeneration on it is the reference. The remote names are
written here from the -hf ones by hand, independently of the loader's mapping (visual/models/internvl_chat.py).

    python -m mmserve.testing.checkpoints.internvl_chat --out DIR --shape 8b    # InternVL3-8B shapes, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from mmserve.testing.checkpoints.internvl import SHAPES, build_internvl_hf
from mmserve.testing.checkpoints.writer import read_checkpoint, write_json

_VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def internvl_chat_config(hf_config: dict, shape: str) -> dict:
    """The remote-code config.json of the -hf config `hf_config` (InternVL3-8B's fields and defaults)."""
    vision, text = hf_config["vision_config"], hf_config["text_config"]
    side = vision["image_size"][0]
    return {
        "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                     "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": side,
        "hidden_size": text["hidden_size"],
        "llm_config": {**{k: v for k, v in text.items() if k != "torch_dtype"}, "torch_dtype": "bfloat16",
                       "use_bfloat16": True, "attn_implementation": "flash_attention_2"},
        "max_dynamic_patch": 12, "min_dynamic_patch": 1, "model_type": "internvl_chat", "pad2square": False,
        "ps_version": "v2", "select_layer": -1, "template": "internvl2_5", "tie_word_embeddings": False,
        "torch_dtype": hf_config["torch_dtype"], "transformers_version": None, "use_backbone_lora": 0,
        "use_llm_lora": 0, "use_thumbnail": True,
        "vision_config": {
            "architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0, "dropout": 0.0,
            "hidden_act": "gelu", "image_size": side, "initializer_factor": 1.0, "initializer_range": 0.02,
            "layer_norm_eps": 1e-06, "model_type": "intern_vit_6b", "norm_type": "layer_norm", "num_channels": 3,
            "patch_size": vision["patch_size"][0], "qk_normalization": False, "qkv_bias": True,
            "torch_dtype": "bfloat16", "use_bfloat16": True, "use_flash_attn": True,
            **{k: vision[k] for k in _VISION_KEYS},
        },
    }  # fmt: skip


# -hf name (as build_internvl_hf writes it with legacy_names) -> the remote code's
_REMOTE_NAMES = (
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.", "vision_model.embeddings.patch_embedding."),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.",
        r"vision_model.encoder.layers.\1.attn.proj.",
    ),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_(\d)$", r"vision_model.encoder.layers.\1.ls\2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.", r"vision_model.encoder.layers.\1.norm1."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.", r"vision_model.encoder.layers.\1.norm2."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
    (r"^language_model\.", "language_model."),
)
_QKV = re.compile(r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")


def remote_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """-hf tensors -> the remote code's, q, k and v fused into `attn.qkv` (in that order)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if m := _QKV.match(name):
            fused.setdefault((m[1], m[3]), {})[m[2]] = tensor
            continue
        for pattern, replacement in _REMOTE_NAMES:
            if re.match(pattern, name):
                out[re.sub(pattern, replacement, name)] = tensor
                break
        else:
            raise ValueError(f"no remote-code name for {name}")
    for (layer, kind), parts in fused.items():
        out[f"vision_model.encoder.layers.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def build_internvl_chat(
    out_dir: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.float32,
    hf_dir: str | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """Write the remote-code layout to out_dir and the same weights in the -hf layout to hf_dir (default
    `<out_dir>-hf`); returns out_dir."""
    hf_dir = hf_dir or out_dir.rstrip("/") + "-hf"
    build_internvl_hf(hf_dir, shape, dtype, legacy_names=True, num_shards=None, seed=seed, device=device)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        write_json(os.path.join(out_dir, "config.json"), internvl_chat_config(json.load(f), shape))
    for name in ("generation_config.json", "tokenizer.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), out_dir)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    for key in ("extra_special_tokens", "chat_template"):  # InternVLProcessor's names; the -hf template
        tokenizer_config.pop(key, None)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    tensors = remote_tensors(read_checkpoint(hf_dir))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight InternVL checkpoint in the remote-code layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 8b, float32 for tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.shape != "tiny" else "float32"))
    build_internvl_chat(args.out, args.shape, dtype, device=args.device)
    print(f"wrote {args.shape} InternVL (remote-code layout) to {args.out} and its -hf twin to {args.out}-hf")


if __name__ == "__main__":
    main()
