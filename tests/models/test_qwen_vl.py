"""Qwen-VL (v1) vision: our timm-based tower + resampler equals an independent plain-torch implementation written
here from the published architecture (OpenCLIP-style ViT with per-head fused qkv, exact GELU, LayerNorm eps 1e-6;
resampler: ln_kv(kv_proj(x)) as keys/values with resized sin-cos positions on the keys, ln_q(query) + positions as
queries, one nn.MultiheadAttention-layout cross-attention, then ln_post and @ proj), on a tiny random checkpoint."""

from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import visual.models.qwen_vl  # noqa: F401  (registers the architecture)
from mmserve.checkpoints.qwen_vl import build_qwen_vl
from visual.models.base import vision_model_class
from visual.models.weights import load_prefixed_tensors

EPS = 1e-6
MEAN, STD = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen_vl(str(tmp_path_factory.mktemp("qwen_vl")))


def _ln(x: torch.Tensor, sd: dict, name: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], EPS)


def _resize_square(table: torch.Tensor, n: int) -> torch.Tensor:
    src, dst = math.isqrt(table.shape[0]), math.isqrt(n)
    if src == dst:
        return table
    grid = table.reshape(1, src, src, -1).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=(dst, dst), mode="bicubic", align_corners=False)[0].flatten(1).T


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, heads, Lq, d] x [B, heads, Lk, d] -> [B, Lq, heads * d], softmax(q k^T / sqrt(d)) v."""
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    out = probs @ v
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def reference_forward(sd: dict, cfg: dict, pixels: torch.Tensor) -> torch.Tensor:
    heads, hd = cfg["heads"], cfg["width"] // cfg["heads"]
    x = F.conv2d(pixels, sd["conv1.weight"], stride=cfg["patch_size"])  # [B, width, g, g]
    x = x.flatten(2).transpose(1, 2)  # [B, L, width]
    b, n, _ = x.shape
    x = _ln(x + _resize_square(sd["positional_embedding"], n), sd, "ln_pre")
    for i in range(cfg["layers"]):
        p = f"transformer.resblocks.{i}."
        qkv = F.linear(_ln(x, sd, p + "ln_1"), sd[p + "attn.in_proj.weight"], sd[p + "attn.in_proj.bias"])
        q, k, v = qkv.view(b, n, heads, 3, hd).permute(3, 0, 2, 1, 4)  # per head: [q | k | v]
        x = x + F.linear(_attend(q, k, v), sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"])
        h = F.gelu(F.linear(_ln(x, sd, p + "ln_2"), sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"]))
        x = x + F.linear(h, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    a = "attn_pool."
    out_dim = cfg["output_dim"]
    rh, rd = out_dim // 128, 128
    kv = _ln(x @ sd[a + "kv_proj.weight"].T, sd, a + "ln_kv")  # [B, L, out]
    queries = _ln(sd[a + "query"], sd, a + "ln_q") + sd[a + "pos_embed"]  # [256, out]
    keys = kv + _resize_square(sd[a + "pos_embed"], n)
    wq, wk, wv = sd[a + "attn.in_proj_weight"].chunk(3)
    bq, bk, bv = sd[a + "attn.in_proj_bias"].chunk(3)
    q = F.linear(queries, wq, bq).view(1, -1, rh, rd).transpose(1, 2).expand(b, -1, -1, -1)
    k = F.linear(keys, wk, bk).view(b, n, rh, rd).transpose(1, 2)
    v = F.linear(kv, wv, bv).view(b, n, rh, rd).transpose(1, 2)
    out = F.linear(_attend(q, k, v), sd[a + "attn.out_proj.weight"], sd[a + "attn.out_proj.bias"])
    return _ln(out, sd, "ln_post") @ sd["proj"]  # [B, 256, out]


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_preprocess_is_bicubic_448_clip_normalised(model_dir: str) -> None:
    vision = vision_model_class("QWenLMHeadModel").from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    img = _image(300, 170, 0)
    ours = vision.preprocess(img)
    expected = np.asarray(img.resize((448, 448), Image.BICUBIC), dtype=np.float64) / 255.0
    expected = torch.from_numpy(((expected - MEAN) / STD).transpose(2, 0, 1)).float()
    assert ours.num_tokens == vision.num_tokens(300, 170) == 256
    torch.testing.assert_close(ours.pixel_values, expected, rtol=0, atol=1e-5)


def test_tower_and_resampler_match_plain_torch(model_dir: str) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)["visual"]
    vision = vision_model_class("QWenLMHeadModel").from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    assert vision.hidden_size == cfg["output_dim"]
    # Through the picklable preprocessor, as the visual process's worker pool runs it.
    preprocess = pickle.loads(pickle.dumps(vision.preprocessor()))
    images = [preprocess(_image(w, h, i)) for i, (w, h) in enumerate([(300, 170), (90, 400)])]
    ours = vision.encode(images)

    sd = load_prefixed_tensors(model_dir, ("transformer.visual.",))
    with torch.no_grad():
        theirs = reference_forward(sd, cfg, torch.stack([im.pixel_values for im in images]))
    assert len(ours) == 2 and ours[0].shape == (256, cfg["output_dim"])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours[0], ours[1], atol=1e-3)  # different images give different embeddings
