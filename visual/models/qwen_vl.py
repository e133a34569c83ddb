"""Qwen-VL (v1) vision: a 448 px OpenCLIP-style ViT (ViT-bigG/14 shape, no class token) built from timm's
VisionTransformer, then a one-layer cross-attention resampler (256 learned queries, 2-D sin-cos positions) and a
final LayerNorm + projection into the LLM's width. Transformers has no class for this remote-code model, so the
published tensors (`transformer.visual.*`) are renamed onto timm's at load."""

from __future__ import annotations

import json
import math
import os
from functools import partial

import torch
import torch.nn.functional as F
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torchvision import transforms

from visual.models.base import ImageInput
from visual.models.weights import load_prefixed_tensors, read_json

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
NUM_QUERIES = 256  # fixed in the published model (not in its config)
LayerNorm = partial(nn.LayerNorm, eps=1e-6)  # every norm of the tower and resampler


def resize_abs_pos(pos: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A square grid of absolute position rows [S*S, C] resized to [num_tokens, C] (bicubic, in fp32) when the grids
    differ, as the published model does on the fly (its tables are 16x16; a 448 px image has 32x32 patches)."""
    src, dst = int(math.isqrt(pos.shape[0])), int(math.isqrt(num_tokens))
    if src == dst:
        return pos
    grid = pos.float().reshape(1, src, src, -1).permute(0, 3, 1, 2)  # [1, C, S, S]
    grid = F.interpolate(grid, size=(dst, dst), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).flatten(0, 2).to(pos.dtype)  # [dst*dst, C]


class Resampler(nn.Module):
    """Cross-attention of learned queries (plus their sin-cos positions) over the projected ViT features (keys
    carry the positions resized to the patch grid)."""

    def __init__(self, embed_dim: int, kv_dim: int, num_patches: int) -> None:
        super().__init__()
        self.num_patches = num_patches
        self.query = nn.Parameter(torch.zeros(NUM_QUERIES, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(NUM_QUERIES, embed_dim), requires_grad=False)
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False) if kv_dim != embed_dim else nn.Identity()
        self.attn = nn.MultiheadAttention(embed_dim, embed_dim // 128, batch_first=True)
        self.ln_q = LayerNorm(embed_dim)
        self.ln_kv = LayerNorm(embed_dim)
        self.register_buffer("key_pos_embed", torch.zeros(num_patches, embed_dim), persistent=False)

    def refresh_key_pos_embed(self) -> None:
        """Resize the query-grid positions to the patch grid once (the input size is fixed)."""
        self.key_pos_embed = resize_abs_pos(self.pos_embed.data, self.num_patches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, patches, kv_dim]
        kv = self.ln_kv(self.kv_proj(x))  # [B, patches, D]
        q = (self.ln_q(self.query) + self.pos_embed).expand(x.shape[0], -1, -1)  # [B, 256, D]
        out, _ = self.attn(q, kv + self.key_pos_embed, kv, need_weights=False)
        return out  # [B, 256, D]


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        image_size, patch = cfg["image_size"], cfg["patch_size"]
        self.vit = VisionTransformer(
            img_size=image_size,
            patch_size=patch,
            embed_dim=cfg["width"],
            depth=cfg["layers"],
            num_heads=cfg["heads"],
            mlp_ratio=cfg["mlp_ratio"],  # int(width * ratio) = 8192 for bigG's 1664 * 4.9231
            qkv_bias=True,
            class_token=False,
            global_pool="",
            num_classes=0,
            pre_norm=True,  # ln_pre; also drops the patch conv's bias, as in CLIP
            final_norm=False,  # the published ln_post is applied after the resampler instead
            norm_layer=LayerNorm,
            act_layer=nn.GELU,  # exact (erf) GELU
        )
        num_patches = (image_size // patch) ** 2
        self.attn_pool = Resampler(cfg["output_dim"], cfg["width"], num_patches)
        self.ln_post = LayerNorm(cfg["output_dim"])
        self.proj = nn.Parameter(torch.zeros(cfg["output_dim"], cfg["output_dim"]))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # pixels: [B, 3, S, S]
        x = self.vit.forward_features(pixels)  # [B, patches, width]
        return self.ln_post(self.attn_pool(x)) @ self.proj  # [B, 256, output_dim]


def timm_state_dict(published: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Rename (and where needed reshape) the published `transformer.visual.*` tensors onto QwenVisionTower."""
    width, heads = cfg["width"], cfg["heads"]
    num_patches = (cfg["image_size"] // cfg["patch_size"]) ** 2
    block_names = {
        "ln_1": "norm1", "ln_2": "norm2", "attn.out_proj": "attn.proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
    }  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for name, t in published.items():
        if name == "conv1.weight":
            out["vit.patch_embed.proj.weight"] = t
        elif name == "positional_embedding":
            out["vit.pos_embed"] = resize_abs_pos(t, num_patches)[None]  # [1, patches, width]
        elif name.startswith("ln_pre."):
            out["vit.norm_pre." + name.removeprefix("ln_pre.")] = t
        elif name.startswith("transformer.resblocks."):
            idx, rest = name.removeprefix("transformer.resblocks.").split(".", 1)
            module, param = rest.rsplit(".", 1)
            if module == "attn.in_proj":
                # The published fused projection is laid out per head ([heads, q|k|v, head_dim]); timm's qkv is
                # [q|k|v, heads, head_dim].
                t = t.reshape(heads, 3, width // heads, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
                module = "attn.qkv"
            out[f"vit.blocks.{idx}.{block_names.get(module, module)}.{param}"] = t
        else:  # attn_pool.*, ln_post.*, proj keep their names
            out[name] = t
    return out


class QwenVLPreprocessor:
    """Picklable image -> ImageInput: the published transform (bicubic resize to a square, no crop, CLIP mean/std)."""

    def __init__(self, image_size: int, patch_size: int) -> None:
        self.patches = (image_size // patch_size) ** 2
        self.transform = transforms.Compose(
            [
                transforms.Resize((image_size, image_size), interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.ToTensor(),  # rescale to [0, 1]
                transforms.Normalize(mean=CLIP_MEAN, std=CLIP_STD),
            ]
        )

    def __call__(self, image: Image.Image) -> ImageInput:
        pixels = self.transform(image.convert("RGB"))  # [3, S, S]
        return ImageInput(pixel_values=pixels, num_tokens=NUM_QUERIES, patches=self.patches)


class QwenVLVisionModel:
    def __init__(self, tower: QwenVisionTower, cfg: dict, cache_salt: str) -> None:
        self.tower = tower.eval()
        self.cache_salt = cache_salt
        self.hidden_size: int = cfg["output_dim"]
        self._preprocessor = QwenVLPreprocessor(cfg["image_size"], cfg["patch_size"])

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> QwenVLPreprocessor:
        """The preprocessor from the config file alone (the pool starts it while the tower loads)."""
        visual = read_json(os.path.join(model_dir, "config.json"))["visual"]
        return QwenVLPreprocessor(visual["image_size"], visual["patch_size"])

    @classmethod
    def from_pretrained(cls, model_dir: str, device: torch.device, dtype: torch.dtype) -> QwenVLVisionModel:
        cfg = read_json(os.path.join(model_dir, "config.json"))["visual"]
        with torch.device(device):
            tower = QwenVisionTower(cfg)
        published = {k: v.to(dtype) for k, v in load_prefixed_tensors(model_dir, ("transformer.visual.",)).items()}
        tower.load_state_dict(timm_state_dict(published, cfg), strict=True)
        tower = tower.to(device=device, dtype=dtype)
        tower.attn_pool.refresh_key_pos_embed()
        salt = json.dumps(["qwen_vl", os.path.realpath(model_dir), cfg["image_size"], str(dtype)])
        return cls(tower, cfg, salt)

    def preprocessor(self) -> QwenVLPreprocessor:
        return self._preprocessor

    def preprocess(self, image: Image.Image) -> ImageInput:
        return self._preprocessor(image)

    def num_tokens(self, width: int, height: int) -> int:
        return NUM_QUERIES

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        ref = self.tower.proj
        pixels = torch.stack([im.pixel_values for im in images]).to(device=ref.device, dtype=ref.dtype)
        return list(self.tower(pixels).unbind(0))  # each [256, output_dim]
