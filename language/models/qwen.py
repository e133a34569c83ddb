"""Qwen-VL / Qwen-VL-Chat's language model (QWenLMHeadModel, remote code on the hub): the same decoder as Qwen2
with MHA, under QWen v1 tensor names. Contexts stay within `seq_length`, where its dynamic NTK and log-n attention
scaling are the identity."""

from __future__ import annotations

from language.config import LMConfig
from language.loader import checkpoint_dtype
from language.models.hf_config import eos_token_ids
from language.models.llama import LlamaForCausalLM

_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_attn": "self_attn.qkv_proj",  # fused q, k, v in that order
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w2": "mlp.gate_proj",  # QWen's MLP is c_proj(w1(x) * silu(w2(x))): w2 is the gate
    "mlp.w1": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


class QWenForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        c = raw_config
        heads = c["num_attention_heads"]
        return LMConfig(
            architecture="QWenLMHeadModel",
            hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=c.get("kv_channels") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"] // 2,  # QWen counts both halves of the gated MLP
            vocab_size=c["vocab_size"],
            rms_norm_eps=c.get("layer_norm_epsilon", 1e-6),
            rope_theta=float(c.get("rotary_emb_base", 10000)),
            max_position=c.get("seq_length", 2048),
            eos_token_ids=eos_token_ids(model_dir, c, None) or (151643,),
            torch_dtype=checkpoint_dtype(c),
            qkv_bias=True,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )

    def checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return name
        if not name.startswith("transformer.") or name.startswith("transformer.visual."):
            return None
        name = name.removeprefix("transformer.")
        if name.startswith("wte."):
            return "embed_tokens." + name.removeprefix("wte.")
        if name.startswith("ln_f."):
            return "norm." + name.removeprefix("ln_f.")
        if name.startswith("h."):
            _, layer, rest = name.split(".", 2)
            module, param = rest.rsplit(".", 1)
            return f"layers.{layer}.{_LAYER_NAMES.get(module, module)}.{param}"
        return None
