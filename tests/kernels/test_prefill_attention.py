import importlib

import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, dtype_params, poisoned, ragged_batch, randn

from language.kernels.prefill_attention import prefill_attention
from language.kernels.reference import prefill_attention_ref

# The package rebinds the name `prefill_attention` to its dispatching function, so fetch the module itself.
prefill_module = importlib.import_module("language.kernels.prefill_attention")

# (query lengths, cached prefix lengths): ragged, with 1-token sequences, and tiles that end mid-sequence.
NO_PREFIX = ([1, 37, 5, 18], [0, 0, 0, 0])
WITH_PREFIX = ([3, 1, 20, 16], [13, 30, 0, 5])  # incl. a single new token behind a long cached prefix
LONG = ([150, 1, 70], [0, 90, 3])  # more than one 64/128-wide GPU tile per sequence


def force_gqa_pack(monkeypatch, pack: int) -> None:
    """Keep the launch table's tiles but force GQA packing on or off, so both kernel paths are checked."""
    default = prefill_module._launch_config
    monkeypatch.setattr(prefill_module, "_launch_config", lambda *a: {**default(*a), "PACK_GQA": pack})


@pytest.fixture(params=[1, 0], ids=["packed", "unpacked"])
def gqa_pack(request, monkeypatch):
    force_gqa_pack(monkeypatch, request.param)
    return request.param


def run_case(q_lens, prefix_lens, num_heads, num_kv_heads, head_dim, dtype, max_q_len_known=True):
    gen = torch.Generator().manual_seed(sum(q_lens) * num_heads + head_dim)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    batch = ragged_batch(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = randn(sum(q_lens), num_heads, head_dim, dtype=dtype, generator=gen)
    b_q_len = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    b_q_start = (torch.cumsum(b_q_len, 0) - b_q_len).int()
    args = (q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.b_req_idx, b_q_start, b_q_len, batch.b_seq_len)
    scale = head_dim**-0.5
    out = poisoned(tuple(q.shape), dtype)
    result = prefill_attention(*args, scale, max_q_len=max(q_lens) if max_q_len_known else None, out=out)
    assert result is out
    assert_written_and_close(out, prefill_attention_ref(*args, scale), ATTENTION_TOL)


@dtype_params
@pytest.mark.parametrize("case", [NO_PREFIX, WITH_PREFIX], ids=["no_prefix", "cached_prefix"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, pack", [(4, 4, 1), (6, 2, 0), (7, 1, 1)], ids=["mha", "gqa3_unpacked", "gqa7_packed"]
)
def test_prefill_attention_matches_reference(dtype, case, num_heads, num_kv_heads, pack, monkeypatch):
    force_gqa_pack(monkeypatch, pack)
    run_case(*case, num_heads, num_kv_heads, head_dim=32, dtype=dtype)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_prefill_attention_head_dims(head_dim):
    run_case(*WITH_PREFIX, num_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=torch.float16)


def test_prefill_attention_long_sequences(gqa_pack):
    run_case(*LONG, num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, max_q_len_known=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tile table applies to compiled kernels only")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_q_len", [100, 700, 1500])
def test_prefill_attention_gpu_table_configs(head_dim, max_q_len, gqa_pack):
    """Each row of the launch table (picked by head dim and the longest prompt) on Qwen2-VL-like 7/1 heads, ragged
    with a cached prefix; on CPU the interpreter always takes its small tiles."""
    q_lens = [max_q_len, 1, max_q_len // 3 + 5]
    run_case(q_lens, [0, 200, 77], 7, 1, head_dim=head_dim, dtype=torch.bfloat16)


def test_prefill_attention_reads_strided_queries():
    """q as a view into a fused qkv projection output: rows further apart than Hq * D."""
    gen = torch.Generator().manual_seed(5)
    q_lens, num_heads, num_kv_heads, head_dim = [4, 9], 4, 2, 32
    batch = ragged_batch(q_lens, num_kv_heads, head_dim, torch.float32, gen)
    qkv = randn(13, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(13, num_heads, head_dim)
    b_q_len = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    b_q_start = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.b_req_idx, b_q_start, b_q_len, batch.b_seq_len)
    assert_written_and_close(prefill_attention(*args, 0.2), prefill_attention_ref(*args, 0.2), ATTENTION_TOL)


def test_prefill_attention_rejects_indivisible_heads():
    q = torch.zeros(3, 5, 16, device=DEVICE)
    cache = torch.zeros(8, 2, 16, device=DEVICE)
    idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        prefill_attention(q, cache, cache, torch.zeros(1, 8, dtype=torch.int32, device=DEVICE), idx, idx, idx, idx, 1.0)
