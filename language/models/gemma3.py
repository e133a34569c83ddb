"""Gemma 3's language model (`Gemma3ForConditionalGeneration`'s text part), on the engine's attention kernels.

What differs from Llama, each as HF's Gemma3TextModel does it:
- the token embeddings are scaled by sqrt(hidden), rounded to the model's dtype first (image rows are not);
- RMSNorm multiplies by (1 + weight), in fp32, then rounds; q and k are normalised per head before the rotary;
- four norms a layer: before and after the attention, before and after the MLP (GELU-tanh gated). A sublayer's
  output is normalised before its residual add, so each add sits between two norms: post-attention norm, add,
  pre-feedforward norm in one launch, and across layers post-feedforward norm, add, the next input norm (or the
  final norm) in one launch, by the next layer: a layer hands on its MLP output before its post-feedforward norm;
- the attention scale is query_pre_attn_scalar ** -0.5;
- `layer_types`: sliding-window layers (their own rotary base, rope_local_base_freq) and global ones (rope_theta,
  with linear rope scaling on 4B and up): the window is each layer's attention option;
- an image's tokens see each other in both directions during prefill (`bidirectional_images`);
- optional tanh softcapping of the final logits.

Tensor names: `language_model.model.*` (as published) or `model.language_model.*` (as transformers 5 saves); the
head is tied to the embeddings unless the checkpoint has `lm_head.weight`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig

from language import kernels
from language.config import LMConfig
from language.forward_batch import ForwardBatch
from language.models.hf_config import lm_config_from_hf
from language.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from language.parallel.group import TPGroup
from language.parallel.sharding import Shard

_LM_PREFIXES = ("language_model.model.", "model.language_model.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


@dataclass(frozen=True)
class Gemma3Config(LMConfig):
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for a global layer
    local_rope_theta: float = 10000.0  # the sliding layers' rotary base
    rope_factor: float = 1.0  # linear rope scaling of the global layers
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None


class GemmaRMSNorm(nn.Module):
    """HF's Gemma3RMSNorm: normalise and scale by (1 + weight) in fp32, then round to x's dtype."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.gemma_rms_norm(x, self.weight, self.eps)


class Gemma3Attention(Attention):
    """Llama's fused q/k/v and kernels, with Gemma's q/k norms, scale, window and this layer's rotary half."""

    def __init__(self, cfg: Gemma3Config, layer_id: int, shard: Shard, tp: TPGroup):
        super().__init__(cfg, layer_id, shard, tp)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.layer_windows[layer_id]

    def unrotated_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """As Llama's, with Gemma's norms (always on)."""
        qk = qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)
        return kernels.qk_rms_norm(
            qk, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps, gemma=True
        )  # [n, Hq + Hk, D]

    def layer_cos_sin(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, D] hold the global layers' angles, then the sliding layers': this layer takes its half."""
        half = self.head_dim // 2
        return (cos[:, half:], sin[:, half:]) if self.window else (cos[:, :half], sin[:, :half])


class GeluMLP(MLP):
    def activation(self, gate_up: torch.Tensor) -> torch.Tensor | kernels.QuantizedRows | kernels.MeasuredRows:
        """[gate | up] -> gelu_tanh(gate) * up, in the form down_proj takes it."""
        return kernels.GELU_TANH_AND_MUL_FOR[self.down_proj.input_form(gate_up.shape[0])](gate_up)


class Gemma3DecoderLayer(DecoderLayer):
    """Llama's layer with Gemma's norms, attention and GELU MLP, and two more norms: after the attention and around
    the MLP."""

    attention_class = Gemma3Attention
    mlp_class = GeluMLP
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: Gemma3Config, layer_id: int, shard: Shard, tp: TPGroup):
        super().__init__(cfg, layer_id, shard, tp)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The previous layer's post-feedforward norm, which this layer applies (set by the model; a tuple, so that
        # the module is not registered twice).
        self.previous_post_feedforward: tuple[GemmaRMSNorm, ...] = ()

    def attention_input(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output before its post-feedforward norm, or the embeddings with residual
        None -> (the attention's input, the residual stream): that norm, the residual add and the input norm."""
        norm = self.input_layernorm
        if residual is None:
            return norm(x), x
        (previous,) = self.previous_post_feedforward
        return kernels.gemma_norm_add_norm(x, residual, previous.weight, norm.weight, norm.eps)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP's output, not yet normalised: the next layer's or the final norm does that, the stream)."""
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        h, residual = kernels.gemma_norm_add_norm(
            self.self_attn.output(attn), residual, post.weight, pre.weight, pre.eps
        )
        return self.mlp(h), residual


def _inv_freq(theta: float, head_dim: int, factor: float = 1.0) -> torch.Tensor:
    """[D/2] fp32 rotary frequencies (HF's default and linear rope types: linear divides them by the factor)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)) / factor


class Gemma3ForCausalLM(LlamaForCausalLM):
    bidirectional_images = True
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> Gemma3Config:
        raw_text = raw_config.get("text_config") or {}
        bias = bool(raw_text.get("attention_bias", False))
        base = lm_config_from_hf(model_dir, raw_config, qkv_bias=bias, qk_norm=True, plain_rope=False)  # _rope
        hf = AutoConfig.for_model(
            raw_config["model_type"], **{k: v for k, v in raw_config.items() if k != "model_type"}
        )
        text = hf.get_text_config()
        if getattr(text, "attn_logit_softcapping", None):
            raise ValueError("Gemma 3 with attn_logit_softcapping is not served")
        global_theta, factor, local_theta = _rope(text, raw_text)
        windows = tuple(text.sliding_window if t == "sliding_attention" else 0 for t in text.layer_types)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LMConfig)}
        fields.update(rope_theta=global_theta, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", True)))
        return Gemma3Config(
            **fields,
            layer_windows=windows,
            local_rope_theta=local_theta,
            rope_factor=factor,
            query_pre_attn_scalar=float(text.query_pre_attn_scalar),
            final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        )

    def __init__(self, cfg: Gemma3Config, tp: TPGroup | None = None):
        super().__init__(cfg, tp)
        self._embed_scale: dict[torch.dtype, float] = {}
        # [D]: the global layers' frequencies, then the sliding layers': one launch computes both layers' angles.
        global_freq = _inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_factor)
        self.inv_freq = torch.cat([global_freq, _inv_freq(cfg.local_rope_theta, cfg.head_dim)])
        for previous, layer in zip(self.layers, self.layers[1:], strict=False):
            layer.previous_post_feedforward = (previous.post_feedforward_layernorm,)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [N, D]: the global layers' angles [N, D/2], then the sliding layers'."""
        return kernels.rotary_cos_sin(positions, self.inv_freq.float())

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(batch.input_ids) * self.embed_scale(self.embed_tokens.weight.dtype)
        if batch.mm_embeds is not None:  # image rows as the projector gave them: not scaled
            kernels.splice_embeddings(x, batch.mm_embeds, batch.mm_positions)
        cos, sin = self.rotary(batch.positions)
        return x, cos, sin

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to the model's dtype, as HF multiplies by it."""
        if dtype not in self._embed_scale:
            self._embed_scale[dtype] = float(torch.tensor(self.cfg.hidden_size**0.5, dtype=dtype))
        return self._embed_scale[dtype]

    def logits(self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.logits_idx is not None:  # only each sequence's last row reaches the head
            x, residual = x[batch.logits_idx], residual[batch.logits_idx]
        last = self.layers[-1].post_feedforward_layernorm  # the last MLP's norm, its add, then the final norm
        normed, _ = kernels.gemma_norm_add_norm(x, residual, last.weight, self.norm.weight, self.norm.eps)
        logits = self.lm_head(normed)  # [num_seqs, vocab], the head's dtype (as Llama's) unless soft-capped
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits.float() / cap) * cap if cap else logits

    def checkpoint_name(self, name: str) -> str | None:
        """The decoder's tensors by our names; the tower and projector are the visual process's: None."""
        for prefix in _LM_PREFIXES:
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        return "lm_head.weight" if name in _LM_HEADS else None


def _rope(text, raw_text: dict) -> tuple[float, float, float]:
    """(global rope theta, its linear scaling factor, the sliding layers' theta), from transformers 5's per-layer-type
    `rope_parameters` or the published keys (rope_theta, rope_scaling, rope_local_base_freq)."""
    params = getattr(text, "rope_parameters", None) or {}
    if "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:
        full = {**(raw_text.get("rope_scaling") or {}), "rope_theta": raw_text.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": raw_text.get("rope_local_base_freq", 10_000.0)}
    for p in (full, local):
        if p.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"Gemma 3 with rope type {p['rope_type']!r} is not served (default and linear are)")
    factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
    return float(full.get("rope_theta", 1_000_000.0)), factor, float(local.get("rope_theta", 10_000.0))
