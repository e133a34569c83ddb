"""The sharded layers on 2 gloo ranks equal the unsharded layers: a row-parallel linear (columns of its input per
rank, partial sums all-reduced), the vocabulary-parallel embedding and lm_head (with a vocabulary that does not
split evenly: the last rank's rows are padded), and column slices taken by heads from fused and separate q/k/v
tensors, KV heads replicated when there are fewer than ranks."""

from __future__ import annotations

import pytest
import torch

from language.config import LMConfig
from language.parallel.sharding import check_divisible, make_shard, take
from tests.parallel.ranks import run_ranks


def _cfg(heads: int = 4, kv_heads: int = 2, vocab: int = 13, inter: int = 12) -> LMConfig:
    return LMConfig("LlamaForCausalLM", hidden_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=2, intermediate_size=inter, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position=64, eos_token_ids=(2,), torch_dtype=torch.float32)  # fmt: skip


@torch.inference_mode()
def _layers_on_rank(rank: int, init_method: str) -> dict[str, float]:
    from language.parallel.group import init_tp
    from language.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

    tp = init_tp(rank, 2, init_method, torch.device("cpu"))
    cfg = _cfg()
    shard = make_shard(cfg, rank, 2)
    g = torch.Generator().manual_seed(0)  # the same full weights and inputs on every rank
    x = torch.randn(5, cfg.hidden_size, generator=g)
    ids = torch.tensor([0, 6, 7, 12, 3])
    down_w = torch.randn(cfg.hidden_size, cfg.intermediate_size, generator=g)
    h = torch.randn(5, cfg.intermediate_size, generator=g)
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    errors = {}

    down = RowParallelLinear(shard.intermediate, cfg.hidden_size, tp)
    down.weight.data.copy_(take(shard, "down_proj", None, down_w))
    local_h = h[:, shard.inter0 : shard.inter0 + shard.intermediate]
    errors["row"] = (down(local_h) - h @ down_w.T).abs().max().item()

    embed = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, shard.vocab0, tp)
    embed.weight.data[: shard.vocab_rows] = take(shard, "embed_tokens", None, table)
    errors["embed"] = (embed(ids) - table[ids]).abs().max().item()

    head = ParallelLMHead(cfg.hidden_size, shard.vocab, cfg.vocab_size, tp)
    head.weight.data.zero_()
    head.weight.data[: shard.vocab_rows] = take(shard, "lm_head", None, table)
    logits = head(x)
    errors["lm_head"] = (logits - x @ table.T).abs().max().item() if logits.shape == (5, cfg.vocab_size) else 1e9
    torch.distributed.destroy_process_group()
    return errors


def test_sharded_layers_equal_unsharded():
    errors = run_ranks(_layers_on_rank)
    assert all(e < 1e-5 for e in errors.values()), errors


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


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_divisible(_cfg(), 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible(_cfg(heads=8, kv_heads=3), 2)
    with pytest.raises(ValueError, match="MLP width"):
        check_divisible(_cfg(inter=10), 4)
