"""InternVL's remote-code layout as published (`InternVLChatModel`: OpenGVLab/InternVL3-8B, InternVL2_5-*) read as
transformers' native one, so that the same tower, pixel shuffle and projector serve it (visual/models/internvl.py):
its config.json (`vision_config` of `intern_vit_6b`, `llm_config`, `force_image_size`, `min_dynamic_patch` /
`max_dynamic_patch`, `use_thumbnail`, `dynamic_image_size`, `select_layer`, `ps_version`, `downsample_ratio`) becomes
an InternVLConfig and a GotOcr2 image processor, and its tensors (`vision_model.*` with a fused `attn.qkv`, `mlp1.*`)
get transformers' names, as transformers' conversion script (convert_internvl_weights_to_hf.py) maps them."""

from __future__ import annotations

import re

import torch
from transformers import GotOcr2ImageProcessor, InternVLConfig

ARCHITECTURE = "InternVLChatModel"
IMAGENET_MEAN = [0.485, 0.456, 0.406]  # the remote code's build_transform normalises with ImageNet's statistics
IMAGENET_STD = [0.229, 0.224, 0.225]
TOWER_PREFIX = "vision_model."
PROJECTOR_PREFIX = "mlp1."
# The remote code's names -> transformers' (convert_internvl_weights_to_hf.py's vision mapping), in this order
_TOWER_RENAMES = (
    (r"^embeddings\.class_embedding$", "embeddings.cls_token"),
    (r"^embeddings\.position_embedding$", "embeddings.position_embeddings"),
    (r"^embeddings\.patch_embedding\.", "embeddings.patch_embeddings.projection."),
    (r"^encoder\.layers\.", "encoder.layer."),
    (r"\.ls(\d)$", r".lambda_\1"),
    (r"\.attn\.proj\.", ".attention.projection_layer."),
    (r"\.attn\.", ".attention."),
    (r"\.norm1\.", ".layernorm_before."),
    (r"\.norm2\.", ".layernorm_after."),
)
_PROJECTOR_NAMES = {"0": "layer_norm", "1": "linear_1", "3": "linear_2"}  # mlp1: LayerNorm, Linear, GELU, Linear


def is_chat_layout(raw: dict) -> bool:
    return (raw.get("architectures") or [""])[0] == ARCHITECTURE


def chat_config(raw: dict) -> InternVLConfig:
    """config.json of the remote-code layout -> the InternVLConfig transformers' conversion writes for it."""
    if raw.get("ps_version", "v2") != "v2":
        raise ValueError(
            f"InternVL ps_version {raw['ps_version']!r}: only v2's pixel shuffle (InternVL2.5, 3) is served"
        )
    if raw.get("pad2square"):
        raise ValueError("InternVL pad2square checkpoints are not served (InternVL2.5 and 3 do not pad)")
    vision = dict(raw["vision_config"])
    renamed = {"qkv_bias": "attention_bias", "qk_normalization": "use_qk_norm"}
    vision = {renamed.get(k, k): v for k, v in vision.items() if k not in ("architectures", "model_type", "auto_map")}
    vision["image_size"] = raw.get("force_image_size") or vision.get("image_size", 448)
    vision["use_absolute_position_embeddings"] = True
    llm = {k: v for k, v in raw["llm_config"].items() if k not in ("architectures", "auto_map")}
    if llm.get("model_type") == "internlm2":  # transformers has no InternLM2 config; the tower needs only the width
        llm = {"model_type": "llama", "hidden_size": llm["hidden_size"]}
    return InternVLConfig(
        vision_config=vision,
        text_config=llm,
        downsample_ratio=raw.get("downsample_ratio", 0.5),
        vision_feature_layer=raw.get("select_layer", -1),
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=int(
            (vision["image_size"] // vision["patch_size"]) ** 2 * raw.get("downsample_ratio", 0.5) ** 2
        ),
    )


def chat_image_processor(raw: dict, config: InternVLConfig) -> tuple[GotOcr2ImageProcessor, dict]:
    """The remote code's `dynamic_preprocess` + `build_transform` as transformers' GotOcr2 processor does them (the
    processor transformers' conversion writes, with the config's tile bounds), and the kwargs that turn tiling on."""
    side = config.vision_config.image_size[0]
    processor = GotOcr2ImageProcessor(
        size={"height": side, "width": side}, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
        min_patches=raw.get("min_dynamic_patch", 1), max_patches=raw.get("max_dynamic_patch", 12),
    )  # fmt: skip
    if not raw.get("use_thumbnail", True):
        raise ValueError("InternVL checkpoints without use_thumbnail are not served (transformers always adds it)")
    return processor, {"crop_to_patches": bool(raw.get("dynamic_image_size", True))}


def tower_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`vision_model.*` tensors (prefix stripped) -> InternVLVisionModel's state, the fused qkv split in q, k, v."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _TOWER_RENAMES:
            name = re.sub(pattern, replacement, name)
        if ".attention.qkv." in name:
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3), strict=True):
                state[name.replace(".qkv.", f".{proj}.")] = part
        else:
            state[name] = tensor
    return state


def projector_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`mlp1.{0,1,3}.*` (prefix stripped) -> InternVLMultiModalProjector's state."""
    out = {}
    for name, tensor in tensors.items():
        index, _, rest = name.partition(".")
        out[f"{_PROJECTOR_NAMES[index]}.{rest}"] = tensor
    return out
