"""The sharded layers on 2 gloo ranks against the unsharded layers, rounding included: a row-parallel linear
(columns of its input per rank, partial sums all-reduced in fp32 and rounded once, as TP=1's GEMM), the
vocabulary-parallel embedding and lm_head, exact (with a vocabulary that does not split evenly: the last rank's
rows are padded), and column slices taken by heads from fused and separate q/k/v tensors, KV heads replicated
when there are fewer than ranks, and InternLM2's packed `wqkv` unpacked to the same slices."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from language.config import LMConfig
from language.parallel.sharding import check_divisible, make_shard, take
from tests.parallel.ranks import run_ranks


def _cfg(heads: int = 4, kv_heads: int = 2, vocab: int = 13, inter: int = 12) -> LMConfig:
    return LMConfig("LlamaForCausalLM", hidden_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=2, intermediate_size=inter, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position=64, eos_token_ids=(2,), torch_dtype=torch.float32)  # fmt: skip


def _row_parallel(tp, shard, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The sharded down_proj of full weight w [out, in] on this rank, applied to this rank's columns of x [n, in]."""
    from language.parallel.layers import RowParallelLinear

    layer = RowParallelLinear(shard.intermediate, w.shape[0], tp).to(w.dtype)
    layer.weight.data.copy_(take(shard, "down_proj", None, w))
    return layer(x[:, shard.inter0 : shard.inter0 + shard.intermediate])


@torch.inference_mode()
def _layers_on_rank(rank: int, init_method: str) -> bytes:
    """Every layer at once (one spawn of the ranks): what the tests compare, saved (the tensors outlive the
    rank's process, which a queue's shared memory would not)."""
    from language.parallel.group import init_tp
    from language.parallel.layers import ParallelLMHead, VocabParallelEmbedding
    from language.quant.head import Fp8LMHead

    tp = init_tp(rank, 2, init_method, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)  # the same full weights and inputs on every rank
    out: dict[str, object] = {}

    # fp32, on the tiny config's shapes: the sharded sum reassociates the unsharded one.
    cfg = _cfg()
    shard = make_shard(cfg, rank, 2)
    h = torch.randn(5, cfg.intermediate_size, generator=g)
    down_w = torch.randn(cfg.hidden_size, cfg.intermediate_size, generator=g)
    out["row_fp32"] = (_row_parallel(tp, shard, h, down_w), h, down_w)

    # bf16 at a 7B-like width of the reduced dimension: what TP=1's GEMM gives (fp32 sums, one rounding).
    wide = make_shard(_cfg(inter=1024), rank, 2)
    h = torch.randn(64, 1024, generator=g).bfloat16()
    down_w = torch.randn(96, 1024, generator=g).bfloat16()
    out["row_bf16"] = (_row_parallel(tp, wide, h, down_w), h, down_w)

    ids = torch.tensor([0, 6, 7, 12, 3])
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(dtype)
        embed = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, shard.vocab0, tp).to(dtype)
        embed.weight.data[: shard.vocab_rows] = take(shard, "embed_tokens", None, table)
        head = ParallelLMHead(cfg.hidden_size, shard.vocab, cfg.vocab_size, tp).to(dtype)
        head.weight.data.zero_()
        head.weight.data[: shard.vocab_rows] = take(shard, "lm_head", None, table)
        x = torch.randn(5, cfg.hidden_size, generator=g).to(dtype)
        out[f"embed_{dtype}"] = (embed(ids), table[ids])
        out[f"lm_head_{dtype}"] = (head(x), x, table, shard.vocab)
        out[f"fp8_lm_head_{dtype}"] = (Fp8LMHead.quantized(head)(x), x, table, shard.vocab)
    torch.distributed.destroy_process_group()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, object]:
    return torch.load(io.BytesIO(run_ranks(_layers_on_rank)))


def test_row_parallel_fp32_equals_unsharded_to_fp32_rounding(on_two_ranks):
    """In fp32 the two ranks' partial sums added are the unsharded dot products summed in another order: equal
    within the reassociation bound, K * 2^-24 * sum |x_k w_k| per output."""
    y, h, w = on_two_ranks["row_fp32"]
    bound = h.shape[1] * 2.0**-24 * (h.abs() @ w.abs().T)
    assert ((y - h @ w.T).abs() <= bound).all()


def test_row_parallel_bf16_rounds_once_as_tp1(on_two_ranks):
    """TP=1's bf16 GEMM sums in fp32 and rounds once. The row-parallel layer must do the same (fp32 partials,
    fp32 all-reduce, one rounding): then it misses TP=1 only where the two fp32 sums straddle a bf16 rounding
    boundary (none here). Reducing bf16 partials, as the layer once did, misses TP=1 on about a third of the
    outputs: this test fails if the reduction goes back to bf16."""
    y, h, w = on_two_ranks["row_bf16"]
    assert y.dtype == torch.bfloat16
    tp1 = (h.float() @ w.float().T).bfloat16()  # [64, 96]: TP=1's GEMM, fp32 sums rounded once (up to their order)
    half = h.shape[1] // 2
    partials = [(h[:, s].float() @ w[:, s].float().T).bfloat16() for s in (slice(0, half), slice(half, None))]
    bf16_reduced = partials[0] + partials[1]  # [64, 96] bf16: what a bf16 all-reduce gives
    differ = (y != tp1).float().mean().item()
    differ_bf16 = (bf16_reduced != tp1).float().mean().item()
    assert differ <= 0.01 and differ_bf16 > 0.2, (differ, differ_bf16)
    ulp = 2.0 ** (torch.frexp(tp1.float())[1] - 8)  # bf16's spacing at each value
    assert ((y.float() - tp1.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_embedding_is_exact(on_two_ranks, dtype):
    """Each id's row comes from one rank and zeros from the others: the sum is the row, bit for bit."""
    ours, want = on_two_ranks[f"embed_{dtype}"]
    assert ours.dtype == dtype and torch.equal(ours, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_lm_head_gathers_without_rounding(on_two_ranks, dtype):
    """Each rank's logits are whole dot products over the hidden size (its vocabulary rows; the last rank's are
    padded); the gather only moves them: the full [n, vocab] logits are each rank's own, bit for bit, in the
    model's dtype, and equal the unsharded head's."""
    logits, x, table, rows = on_two_ranks[f"lm_head_{dtype}"]
    vocab = table.shape[0]
    assert logits.shape == (5, vocab) and logits.dtype == dtype
    per_rank = [torch.nn.functional.linear(x, table[r * rows : (r + 1) * rows]) for r in range(2)]
    assert torch.equal(logits, torch.cat(per_rank, dim=1))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits, torch.nn.functional.linear(x, table), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_fp8_lm_head_equals_tp1(on_two_ranks, dtype):
    """The FP8 head (--quant_type fp8w8a8): each rank's e4m3 rows and their scales are tp=1's rows (a scale per
    vocabulary row), and its input, the whole hidden row, is quantized alike on every rank: the gathered logits are
    each rank's quantized dot products, bit for bit, and tp=1's quantized head's up to the order of the sums."""
    from language.quant.fp8 import fp8_linear_ref, quantize_weight

    logits, x, table, rows = on_two_ranks[f"fp8_lm_head_{dtype}"]
    assert logits.shape == (5, table.shape[0]) and logits.dtype == dtype
    per_rank = [fp8_linear_ref(x, *quantize_weight(table[r * rows : (r + 1) * rows])) for r in range(2)]
    assert torch.equal(logits, torch.cat(per_rank, dim=1))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits, fp8_linear_ref(x, *quantize_weight(table)), rtol=tol, atol=tol)
    assert (logits.float() - torch.nn.functional.linear(x, table).float()).abs().max() > 0  # it is quantized


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_qkv_slices_by_heads(kv_heads):
    """Rank r's q heads [2r, 2r+2) and the KV heads they read (split, or the one shared head replicated); the same
    rows whether the checkpoint stores q, k, v apart or fused."""
    cfg = _cfg(kv_heads=kv_heads)
    d, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, kv_heads * cfg.head_dim
    fused = torch.arange(q_size + 2 * kv_size, dtype=torch.float32)[:, None].expand(-1, 3)
    q, k, v = fused[:q_size], fused[q_size : q_size + kv_size], fused[q_size + kv_size :]
    for rank in range(2):
        s = make_shard(cfg, rank, 2)
        kv_head = rank if kv_heads == 2 else 0
        assert (s.heads, s.head0, s.kv_heads, s.kv_head0) == (2, 2 * rank, 1, kv_head)
        want = torch.cat([q[2 * rank * d : (2 * rank + 2) * d], k[kv_head * d : (kv_head + 1) * d],
                          v[kv_head * d : (kv_head + 1) * d]])  # fmt: skip
        apart = torch.cat([take(s, "qkv_proj", i, t) for i, t in enumerate((q, k, v))])
        assert torch.equal(apart, want) and torch.equal(take(s, "qkv_proj", None, fused), want)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_internlm2_wqkv_unpacks_to_each_ranks_qkv_slice(tp):
    """InternLM2's packed `wqkv` (per KV head: its query heads, its key, its value; packed here as the published
    modeling reads it, by the test builder) gives each rank the rows `take` gives it from q, k, v stored apart: KV
    heads split (tp 1, 2) or replicated (tp 4, 8 over 2 KV heads)."""
    from language.models.internvl import unpack_wqkv
    from mmserve.testing.checkpoints.internvl_internlm2 import internlm2_tensors

    cfg = dataclasses.replace(_cfg(heads=8, kv_heads=2, inter=16), hidden_size=16)  # head_dim 2 = 16 / 8
    text = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 16, "num_hidden_layers": 1}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 16, generator=g) for rows in (16, 4, 4))
    names = ("q_proj", "k_proj", "v_proj")
    hf = {f"language_model.model.layers.0.self_attn.{n}.weight": t for n, t in zip(names, (q, k, v), strict=True)}
    hf |= {f"language_model.model.{n}.weight": torch.zeros(1) for n in ("embed_tokens", "norm")}
    hf |= {"language_model.lm_head.weight": torch.zeros(1)}
    hf |= {f"language_model.model.layers.0.{n}.weight": torch.zeros(1) for n in ("self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}  # fmt: skip
    wqkv = internlm2_tensors(hf, text)["language_model.model.layers.0.attention.wqkv.weight"]
    assert wqkv.shape == (24, 16) and not torch.equal(wqkv[:16], q)  # packed, not [q | k | v]
    for rank in range(tp):
        s = make_shard(cfg, rank, tp)
        want = torch.cat([take(s, "qkv_proj", i, t) for i, t in enumerate((q, k, v))])
        assert torch.equal(unpack_wqkv(s, wqkv), want), (tp, rank)


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_divisible(_cfg(), 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible(_cfg(heads=8, kv_heads=3), 2)
    with pytest.raises(ValueError, match="MLP width"):
        check_divisible(_cfg(inter=10), 4)
