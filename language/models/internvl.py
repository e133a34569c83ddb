"""InternVL's language model: the Qwen2 decoder (InternVL3), a Llama one (InternVL2.5's converted InternLM2) or
InternLM2 as published (InternVL2.5-8B), in the transformers-native layout (`InternVLForConditionalGeneration`, the
`-hf` repositories: `text_config`, tensors `model.language_model.*` + `lm_head` since transformers 4.52,
`language_model.model.*` + `language_model.lm_head` before) or the remote-code one (`InternVLChatModel`:
`llm_config`, tensors `language_model.model.*` + `language_model.lm_head`, or InternLM2's names). The image
embeddings are spliced in at the `<IMG_CONTEXT>` positions by the decoder's forward."""

from __future__ import annotations

import re

import torch

from language.config import LMConfig
from language.models.hf_config import lm_config_from_hf
from language.models.llama import LlamaForCausalLM
from language.parallel.sharding import Shard, TensorView

_LM_PREFIXES = ("model.language_model.", "language_model.model.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "language_model.output.weight")
# InternLM2's names (after the prefix) -> the Llama ones; its packed `attention.wqkv` is unpacked by `shard_tensor`
_INTERNLM2_NAMES = (
    (re.compile(r"^tok_embeddings\."), "embed_tokens."),
    (re.compile(r"\.attention\.wqkv\."), ".self_attn.qkv_proj."),
    (re.compile(r"\.attention\.wo\."), ".self_attn.o_proj."),
    (re.compile(r"\.feed_forward\.w1\."), ".mlp.gate_proj."),
    (re.compile(r"\.feed_forward\.w3\."), ".mlp.up_proj."),
    (re.compile(r"\.feed_forward\.w2\."), ".mlp.down_proj."),
    (re.compile(r"\.attention_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
)


class InternVLForCausalLM(LlamaForCausalLM):
    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        text_type = (raw_config.get("text_config") or {}).get("model_type", "qwen2")
        return lm_config_from_hf(model_dir, raw_config, qkv_bias=text_type == "qwen2")

    def checkpoint_name(self, name: str) -> str | None:
        """The decoder's tensors by our names; the tower and projector (`*vision_tower.*`, `*multi_modal_projector.*`,
        `vision_model.*`, `mlp1.*`) are the visual process's: None."""
        for prefix in _LM_PREFIXES:
            if name.startswith(prefix):
                return internlm2_to_llama(name.removeprefix(prefix))
        return "lm_head.weight" if name in _LM_HEADS else None

    def shard_tensor(self, ckpt_name: str, view: TensorView) -> torch.Tensor:
        if ckpt_name.endswith(".attention.wqkv.weight"):
            return unpack_wqkv(self.shard, view)
        return super().shard_tensor(ckpt_name, view)


def unpack_wqkv(s: Shard, view: TensorView) -> torch.Tensor:
    """InternLM2's `wqkv` [(kv_heads * (group + 2) * D), hidden] holds, for each KV head in turn, its group of query
    heads, then its key, then its value -> this rank's rows of our fused [q | k | v]. Only the rows of this rank's KV
    heads are read."""
    d = s.full.head_dim
    group = s.full.num_heads // s.full.num_kv_heads
    rows = (group + 2) * d  # one KV head's block
    block = view[s.kv_head0 * rows : (s.kv_head0 + s.kv_heads) * rows]
    block = block.reshape(s.kv_heads, group + 2, d, block.shape[-1])
    q = block[:, :group].reshape(s.kv_heads * group, d, -1)  # the query heads of these KV heads, in order
    first_q = s.head0 - s.kv_head0 * group  # a rank sharing its KV head holds only some of its group
    q = q[first_q : first_q + s.heads]
    return torch.cat([q.reshape(s.heads * d, -1), block[:, group].reshape(s.kv_heads * d, -1),
                      block[:, group + 1].reshape(s.kv_heads * d, -1)])  # fmt: skip


def internlm2_to_llama(name: str) -> str:
    """An InternLM2 tensor name (prefix stripped) -> the Llama one; other names unchanged."""
    for pattern, replacement in _INTERNLM2_NAMES:
        name = pattern.sub(replacement, name)
    return name


class InternVLChatForCausalLM(InternVLForCausalLM):
    """The remote-code layout: the decoder's fields in `llm_config` (Qwen2, Llama, or InternLM2, InternVL2.5-8B's)."""

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        llm = raw_config["llm_config"]
        text_type = llm.get("model_type")
        if text_type not in ("qwen2", "llama", "internlm2"):
            raise ValueError(f"InternVL with a {text_type!r} language model is not served (Qwen2, Llama, InternLM2)")
        # the top level names the architecture and dtype; the decoder's own fields are llm_config's
        raw = {**llm, "architectures": raw_config["architectures"], "torch_dtype": raw_config.get("torch_dtype")}
        if text_type == "internlm2":  # a Llama decoder under other names (transformers' conversion reads it so)
            if llm.get("bias"):
                raise ValueError("InternLM2 with attention biases is not served (InternVL2.5's have none)")
            raw = {k: v for k, v in raw.items() if k not in ("bias", "auto_map")}
            text_type = "llama"
        return lm_config_from_hf(model_dir, raw, qkv_bias=text_type == "qwen2", model_type=text_type)
