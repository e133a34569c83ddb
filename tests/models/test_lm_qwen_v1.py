"""Qwen-VL's LLM (QWenLMHeadModel names: fused c_attn, w1/w2/c_proj) equals HF Qwen2 built from the same weights
remapped: the two architectures agree, so greedy tokens must match token for token."""

import json
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from tests.models.hf_reference import hf_greedy

HIDDEN, LAYERS, HEADS, MLP, VOCAB = 64, 2, 4, 96, 300


def _qwen_v1_state(hf: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    sd = hf.state_dict()
    out = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        attn = src + "self_attn."
        out[dst + "ln_1.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ln_2.weight"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "attn.c_attn.weight"] = torch.cat([sd[attn + f"{p}_proj.weight"] for p in "qkv"])
        out[dst + "attn.c_attn.bias"] = torch.cat([sd[attn + f"{p}_proj.bias"] for p in "qkv"])
        out[dst + "attn.c_proj.weight"] = sd[attn + "o_proj.weight"]
        out[dst + "mlp.w2.weight"] = sd[src + "mlp.gate_proj.weight"]  # silu'd branch
        out[dst + "mlp.w1.weight"] = sd[src + "mlp.up_proj.weight"]
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.down_proj.weight"]
    # a few vision tensors, as the real checkpoint has: the LLM loader must skip them
    out["transformer.visual.conv1.weight"] = torch.zeros(8, 3, 14, 14)
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=MLP,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # decisive logits: larger random weights than HF's init
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if "embed" in name else 2.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
    folder = tmp_path_factory.mktemp("qwen_v1")
    save_file(_qwen_v1_state(hf), str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = {
        "architectures": ["QWenLMHeadModel"],
        "model_type": "qwen",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "kv_channels": HIDDEN // HEADS,
        "intermediate_size": 2 * MLP,
        "layer_norm_epsilon": 1e-6,
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "seq_length": 2048,
        "use_dynamic_ntk": True,
        "use_logn_attn": True,
        "no_bias": True,
        "vocab_size": VOCAB,
        "eos_token_id": 151643,
        "torch_dtype": "float32",
        "visual": {"heads": 2, "image_size": 28, "layers": 1, "width": 8, "patch_size": 14, "output_dim": HIDDEN},
    }
    (folder / "config.json").write_text(json.dumps(raw))
    return hf, LLM(str(folder), max_total_token_num=2048, device="cpu")


def test_qwen_v1_llm_equals_hf_qwen2(pair):
    hf, llm = pair
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 13, 77)]
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, gen in zip(prompts, ours, strict=True):
        assert gen.token_ids == hf_greedy(hf, prompt, 24)
