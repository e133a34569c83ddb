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
from mmserve.testing.checkpoints.qwen_vl import build_qwen_vl
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


CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<img></img>\n<img></img>\n"
    "Which two cities are shown in these pictures? Compare them.<|im_end|>\n<|im_start|>assistant\n"
)


def _hf_qwen2_from_v1(model_dir: str):
    """HF Qwen2 holding the checkpoint's LLM weights (QWen v1 and Qwen2 with MHA are the same decoder)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    h, layers, heads = raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"]
    cfg = Qwen2Config(
        hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=raw["intermediate_size"] // 2, vocab_size=raw["vocab_size"], rms_norm_eps=1e-6,
        rope_theta=float(raw["rotary_emb_base"]), max_position_embeddings=raw["seq_length"], tie_word_embeddings=False,
    )  # fmt: skip
    sd = load_prefixed_tensors(model_dir, ("transformer.", "lm_head."))
    state = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]}
    state["lm_head.weight"] = sd["weight"]
    for i in range(layers):
        src, dst = f"h.{i}.", f"model.layers.{i}."
        state[dst + "input_layernorm.weight"] = sd[src + "ln_1.weight"]
        state[dst + "post_attention_layernorm.weight"] = sd[src + "ln_2.weight"]
        for kind in ("weight", "bias"):
            q, k, v = sd[src + f"attn.c_attn.{kind}"].chunk(3)
            state.update({dst + f"self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v), strict=True)})
        state[dst + "self_attn.o_proj.weight"] = sd[src + "attn.c_proj.weight"]
        state[dst + "mlp.gate_proj.weight"] = sd[src + "mlp.w2.weight"]
        state[dst + "mlp.up_proj.weight"] = sd[src + "mlp.w1.weight"]
        state[dst + "mlp.down_proj.weight"] = sd[src + "mlp.c_proj.weight"]
    model = Qwen2ForCausalLM(cfg).eval()
    model.load_state_dict(state, strict=True)
    return model


def test_engine_with_images_equals_hf_qwen2_on_spliced_embeddings(model_dir: str) -> None:
    """Prompt expansion + our vision embeddings on the <imgpad> rows + our engine (batched with a text-only
    request) give the greedy tokens of HF Qwen2 run on the same spliced input embeddings."""
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from mmserve.prep.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompter = prompt_processor_class("QWenLMHeadModel").from_pretrained(model_dir, tokenizer)
    vision = vision_model_class("QWenLMHeadModel").from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    pictures = [_image(300, 170, 5), _image(90, 400, 6)]
    mm = prompter.encode(CHAT, [p.size for p in pictures])
    embeds = vision.encode([vision.preprocess(p) for p in pictures])
    text_only = tokenizer.encode("<|im_start|>user\nWhat is AI?<|im_end|>\n<|im_start|>assistant\n")

    llm = LLM(model_dir, max_total_token_num=4096, device="cpu")
    items = [MultimodalItem(offset=o, embeds=e) for o, e in zip(mm.offsets, embeds, strict=True)]
    ours = llm.generate([mm.token_ids, text_only], SamplingParams(max_new_tokens=20, ignore_eos=True), [items, []])

    hf = _hf_qwen2_from_v1(model_dir)
    for ids, placed, gen in [(mm.token_ids, items, ours[0]), (text_only, [], ours[1])]:
        with torch.no_grad():
            x = hf.get_input_embeddings()(torch.tensor([ids]))  # [1, L, hidden]
            for item in placed:
                x[0, item.offset : item.offset + item.num_tokens] = item.embeds
            out = hf.generate(
                inputs_embeds=x, attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=20,
                min_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert gen.token_ids == out[0].tolist()
    assert ours[0].token_ids != ours[1].token_ids
