"""The Llama-family decoder (Llama/Vicuna, Qwen2 with q/k/v bias and GQA, Qwen2-VL's LLM with M-RoPE), built on the
engine's kernels and reading K/V through the TokenAttention slot table."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from language import kernels
from language.config import LMConfig
from language.forward_batch import ForwardBatch
from language.kv_cache import KVCache
from language.models.hf_config import lm_config_from_hf
from language.parallel.group import TPGroup
from language.parallel.layers import Linear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from language.parallel.sharding import Shard, TensorView, make_shard, take
from language.quant.loading import ScaleView, fit_rows, is_scale
from language.quant.scheme import QuantScheme


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): q/k/v column-parallel, o row-parallel."""

    def __init__(self, cfg: LMConfig, layer_id: int, shard: Shard, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = shard.heads, shard.kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = 0  # a sliding-window layer's window (Gemma 3's local layers); 0: every key
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp)
        if cfg.qk_norm:  # Qwen3: each query and key head RMS-normalised (weights [head_dim]) before the rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def project(
        self,
        x: torch.Tensor | kernels.QuantizedRows | kernels.MeasuredRows,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        kv: KVCache,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [n, hidden] (or quantized, for an FP8 qkv_proj) -> q [n, Hq, D], rotated (into q_out where given); the
        rotated k and v are stored at out_slots [n]. Everything here is dense over the rows: piecewise graphs capture
        it (language/piecewise_graphs.py)."""
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        n = qkv.shape[0]
        qk = self.unrotated_qk(qkv)  # [n, Hq + Hk, D]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        cos, sin = self.layer_cos_sin(cos, sin)
        k_cache, v_cache, k_scale, v_scale = kv.layer(self.layer_id)
        # One launch rotates q and k and stores k and v: at decode sizes each launch costs its few microseconds.
        return kernels.rotary_store_kv(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, cos, sin, k_cache, v_cache, out_slots,
            k_scale=k_scale, v_scale=v_scale, out=q_out,
        )  # fmt: skip

    def unrotated_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [n, q_size + 2 * kv_size] -> the q and k heads [n, Hq + Hk, D] as the rotary takes them: a view of
        qkv (q and k sit side by side in each row), or, with qk_norm, normalised (one launch over both)."""
        qk = qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # [n, Hq + Hk, D], contiguous
            qk = kernels.qk_rms_norm(qk, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps)
        return qk

    def layer_cos_sin(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's cos/sin [n, D/2] (embed's) -> this layer's: the same here."""
        return cos, sin

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [n, Hq, D] -> [n, hidden] (summed over ranks)."""
        return self.o_proj(attn.reshape(attn.shape[0], self.q_size))

    def attend(self, q: torch.Tensor, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [n, Hq, D] -> [n, Hq, D] (into `out` where given): the decode kernel for decode rows, the prefill
        kernel for the chunks. This part depends on the step's sequences, so piecewise graphs leave it eager."""
        kv, nd, n = batch.kv, batch.num_decode, q.shape[0]
        k_cache, v_cache, k_scale, v_scale = kv.layer(self.layer_id)
        if nd == n:
            return kernels.decode_attention(
                q, k_cache, v_cache, kv.req_to_token, batch.req_idx, batch.decode_seq_lens, self.scale,
                max_seq_len=batch.max_decode_len, out=out, window=self.window, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        if out is None and nd:
            out = q.new_empty(q.shape)  # [n, Hq, D] contiguous
        prefill_out = kernels.prefill_attention(
            q[nd:], k_cache, v_cache, kv.req_to_token, batch.prefill_req_idx, batch.q_starts, batch.q_lens,
            batch.prefill_seq_lens, self.scale, max_q_len=batch.max_q_len, out=None if out is None else out[nd:],
            window=self.window, key_ends=batch.prefill_key_ends, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        if nd == 0:
            return prefill_out
        kernels.decode_attention(
            q[:nd], k_cache, v_cache, kv.req_to_token, batch.req_idx[:nd], batch.decode_seq_lens, self.scale,
            max_seq_len=batch.max_decode_len, out=out[:nd], window=self.window, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return out


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig, shard: Shard, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * shard.intermediate, bias=False)  # [gate | up]
        self.down_proj = RowParallelLinear(shard.intermediate, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor | kernels.QuantizedRows | kernels.MeasuredRows) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor | kernels.QuantizedRows | kernels.MeasuredRows:
        """[gate | up] -> silu(gate) * up, in the form down_proj takes it."""
        return kernels.SILU_AND_MUL_FOR[self.down_proj.input_form(gate_up.shape[0])](gate_up)


class DecoderLayer(nn.Module):
    attention_class: type[Attention] = Attention
    mlp_class: type[MLP] = MLP
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: LMConfig, layer_id: int, shard: Shard, tp: TPGroup):
        super().__init__()
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, layer_id, shard, tp)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_class(cfg, shard, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output, residual: the stream before it (None for the first layer, whose x is
        the embeddings) -> (this layer's MLP output, the stream before it). Each residual add is fused into the
        next norm: HF's `residual + x`, then RMSNorm, in one launch."""
        q, residual = self.before_attention(x, residual, cos, sin, batch.out_slots, batch.kv)
        return self.after_attention(self.self_attn.attend(q, batch), residual)

    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        kv: KVCache,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [n, Hq, D], into q_out where given; the residual stream [n, hidden]); k and v stored."""
        h, residual = self.attention_input(x, residual)
        return self.self_attn.project(h, cos, sin, out_slots, kv, q_out), residual

    def attention_input(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor | kernels.QuantizedRows | kernels.MeasuredRows, torch.Tensor]:
        """-> (the attention's normalised input, the residual stream): `residual + x` and the norm fused; the input
        in the form the q/k/v projection takes it."""
        norm, form = self.input_layernorm, self.self_attn.qkv_proj.input_form(x.shape[0])
        if residual is None and form is kernels.InputForm.PLAIN:
            return norm(x), x
        if residual is None:
            return kernels.RMS_NORM_FOR[form](x, norm.weight, norm.eps), x
        return kernels.ADD_RMS_NORM_FOR[form](x, residual, norm.weight, norm.eps)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [n, Hq, D], residual [n, hidden] -> (this layer's MLP output, the stream before it)."""
        norm = self.post_attention_layernorm
        add_norm = kernels.ADD_RMS_NORM_FOR[self.mlp.gate_up_proj.input_form(attn.shape[0])]
        h, residual = add_norm(self.self_attn.output(attn), residual, norm.weight, norm.eps)
        return self.mlp(h), residual


# Checkpoint names of the separate projections -> (our fused parameter, which slice of it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Token ids (with optional image embeddings spliced in) -> next-token logits of each sequence's last token."""

    qkv_bias = False
    # Whether an image's tokens attend to each other in both directions during prefill (Gemma 3): the scheduler then
    # never splits an image across prefill chunks, and a step's prefill rows carry ForwardBatch.prefill_key_ends.
    bidirectional_images = False
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm
    quant: QuantScheme | None = None  # set by the loader (language/model_builder.py) for a quantized decoder

    @classmethod
    def lm_config(cls, model_dir: str, raw_config: dict) -> LMConfig:
        return lm_config_from_hf(model_dir, raw_config, qkv_bias=cls.qkv_bias)

    def __init__(self, cfg: LMConfig, tp: TPGroup | None = None):
        """tp: this rank's tensor-parallel group; None (or a group of one): the whole model, no collectives."""
        super().__init__()
        self.cfg = cfg
        tp = tp or TPGroup()
        self.shard = shard = make_shard(cfg, tp.rank, tp.size)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, shard.vocab0, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, shard, tp) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, shard.vocab, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2], kept fp32

    def prepare_request(self, req) -> None:
        """Fill in what this family derives from a request before it runs (e.g. M-RoPE positions); a no-op here."""

    @property
    def mm_embed_width(self) -> int:
        """Columns of one image-embedding row (ForwardBatch.mm_embeds): the hidden size. A family that carries more
        per image token (Qwen3-VL's DeepStack features) widens it."""
        return self.cfg.hidden_size

    @property
    def position_dims(self) -> int:
        """1 for plain positions, 3 for M-RoPE (temporal, height, width)."""
        return 1 if self.cfg.mrope_section is None else 3

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.mrope_section is None:
            return kernels.rotary_cos_sin(positions, self.inv_freq)
        return kernels.mrope_cos_sin(positions, self.inv_freq, list(self.cfg.mrope_section), self.cfg.mrope_interleaved)

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the token embeddings with the images' spliced in [num_tokens, hidden], cos, sin [num_tokens, D/2])."""
        x = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        if batch.mm_embeds is not None:  # the first `hidden` columns: the rest are DeepStack's (Qwen3-VL)
            kernels.splice_embeddings(x, batch.mm_embeds[:, : self.cfg.hidden_size], batch.mm_positions)
        cos, sin = self.rotary(batch.positions)  # [num_tokens, D/2] each
        return x, cos, sin

    def layers_only(self, batch: ForwardBatch) -> bool:
        """True where a step's forward is `embed`, the layers one after another, then `logits`, with nothing in
        between: what piecewise graphs replay. A family that adds work between layers says when it does."""
        return True

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, cos, sin = self.embed(batch)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch)
        return self.logits(x, residual, batch)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The last layer's (output, residual) [num_tokens, hidden] -> [num_seqs, vocab] logits in the LM head's
        dtype: the greedy sampler reads them as they are, and the other samplers take a float32 copy."""
        if batch.logits_idx is not None:  # only each sequence's last row reaches the head
            x, residual = x[batch.logits_idx], residual[batch.logits_idx]  # [num_seqs, hidden]
        normed, _ = kernels.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return self.lm_head(normed)  # [num_seqs, vocab]

    # ---- weights ----
    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to ours (HF Llama names minus the `model.` prefix); None skips it.
        Families with other layouts override this."""
        if name.startswith("model."):
            return name.removeprefix("model.")
        if name.startswith("lm_head."):
            return name
        return None

    def shard_tensor(self, ckpt_name: str, view: TensorView) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor, read from `view` (called by the loader's reader threads, so
        that a rank reads only its part)."""
        name = self.checkpoint_name(ckpt_name) or ckpt_name
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else name
        piece = None
        if module in _FUSED:
            module, piece = _FUSED[module]
        if self.quant is not None and is_scale(name):  # sliced as its weight's rows and columns
            view = ScaleView(view, self.quant)
        return take(self.shard, module, piece, view)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = self.checkpoint_name(ckpt_name)
            if name is None or "rotary_emb" in name:
                continue
            self._load_one(params, name, tensor, loaded)
        missing = set(params) - loaded
        if self.cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        parts = name.split(".")
        fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
        if fused is not None:
            target, shard = fused
            pname = ".".join(parts[:-2] + [target, parts[-1]])
            param = params[pname]
            sizes = self._fused_sizes(target)
            start = sum(sizes[:shard])
            if is_scale(name):
                tensor = fit_rows(tensor, sizes[shard])
            param.data[start : start + sizes[shard]].copy_(tensor)
            loaded.add(pname)
            return
        if name not in params:
            raise ValueError(f"unexpected tensor in checkpoint: {name}")
        target = params[name].data
        if name in ("embed_tokens.weight", "lm_head.weight"):  # this rank's vocabulary rows; the rest is padding
            target = target[: self.shard.vocab_rows]
        if is_scale(name):
            tensor = fit_rows(tensor, target.shape[0])
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model wants {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add(name)

    def _fused_sizes(self, target: str) -> list[int]:
        """The pieces of a fused parameter on this rank."""
        s, d = self.shard, self.cfg.head_dim
        if target == "qkv_proj":
            return [s.heads * d, s.kv_heads * d, s.kv_heads * d]
        return [s.intermediate, s.intermediate]


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
