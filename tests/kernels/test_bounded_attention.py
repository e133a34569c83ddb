"""Sliding windows and bidirectional blocks (Gemma 3): the prefill kernel's bounded path and the decode kernel's
window against the torch reference, which is checked here against a mask written out from HF's definition; and both
over a quantized KV cache (Gemma 3 with --llm_kv_type int8kv / fp8kv)."""

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, dtype_params, poisoned, ragged_batch, randn
from test_kv_quant import quantized
from test_prefill_attention import force_gqa_pack

from language.kernels.decode_attention import decode_attention
from language.kernels.prefill_attention import prefill_attention
from language.kernels.reference import decode_attention_ref, prefill_attention_ref

# (query lengths, cached prefix lengths), and per sequence its bidirectional blocks as (start, end) positions:
# a block inside a chunk, one that starts in the cached prefix (the chunk starts inside it), two side by side.
Q_LENS, PREFIX_LENS = [40, 1, 27, 19], [0, 30, 9, 50]
BLOCKS = [[(3, 11), (20, 37)], [], [(5, 20)], [(52, 60), (60, 66)]]


def key_ends(q_lens, prefix_lens, blocks) -> torch.Tensor:
    """Per query row: the end of its block, or 0 (text)."""
    ends = []
    for q_len, prefix, spans in zip(q_lens, prefix_lens, blocks, strict=True):
        for pos in range(prefix, prefix + q_len):
            ends.append(next((e for s, e in spans if s <= pos < e), 0))
    return torch.tensor(ends, dtype=torch.int64, device=DEVICE)


def hf_mask(seq_len: int, q_positions: range, spans, window: int) -> torch.Tensor:
    """HF Gemma 3's mask, written out: (causal OR same block) AND (window, if any). [q, k] bool, True = seen."""
    group = torch.full((seq_len,), -1)
    for i, (s, e) in enumerate(spans):
        group[s:e] = i
    q = torch.tensor(list(q_positions))[:, None]
    k = torch.arange(seq_len)[None, :]
    seen = (k <= q) | ((group[q] == group[k]) & (group[q] >= 0))
    return seen & (k > q - window) if window else seen


def inputs(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(7)
    seq_lens = [q + p for q, p in zip(Q_LENS, PREFIX_LENS, strict=True)]
    batch = ragged_batch(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = randn(sum(Q_LENS), num_heads, head_dim, dtype=dtype, generator=gen)
    b_q_len = torch.tensor(Q_LENS, dtype=torch.int32, device=DEVICE)
    b_q_start = (torch.cumsum(b_q_len, 0) - b_q_len).int()
    return q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.b_req_idx, b_q_start, b_q_len, batch.b_seq_len


@pytest.mark.parametrize("window", [0, 8])
def test_reference_is_hf_mask(window):
    """The reference's (window, key_ends) equal HF's mask, computed here by dense softmax per sequence."""
    args = inputs(2, 1, 16, torch.float32)
    q, k_cache, v_cache, req_to_token, b_req_idx, _, _, b_seq_len = args
    ends = key_ends(Q_LENS, PREFIX_LENS, BLOCKS)
    got = prefill_attention_ref(*args, 0.25, window=window, key_ends=ends)
    start = 0
    for b, (q_len, prefix, spans) in enumerate(zip(Q_LENS, PREFIX_LENS, BLOCKS, strict=True)):
        seq_len = int(b_seq_len[b])
        slots = req_to_token[int(b_req_idx[b]), :seq_len].long()
        k, v = k_cache[slots].float(), v_cache[slots].float()  # [L, 1, D]
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].float(), k.expand(-1, 2, -1)) * 0.25
        mask = hf_mask(seq_len, range(prefix, prefix + q_len), spans, window).to(scores.device)  # built on the CPU
        scores = scores.masked_fill(~mask[None], float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.expand(-1, 2, -1))
        torch.testing.assert_close(got[start : start + q_len], want, rtol=1e-5, atol=1e-5)
        start += q_len


@dtype_params
@pytest.mark.parametrize("window", [0, 5, 16, 200], ids=["no_window", "window5", "window16", "window_past_all"])
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "no_blocks"])
@pytest.mark.parametrize("pack", [1, 0], ids=["packed", "unpacked"])
def test_prefill_bounded_matches_reference(dtype, window, blocks, pack, monkeypatch):
    if window == 0 and not blocks:
        pytest.skip("plain causal: tests/kernels/test_prefill_attention.py")
    force_gqa_pack(monkeypatch, pack)
    args = inputs(4, 2, 32, dtype)
    ends = key_ends(Q_LENS, PREFIX_LENS, BLOCKS) if blocks else None
    out = poisoned(tuple(args[0].shape), dtype)
    prefill_attention(*args, 0.2, max_q_len=max(Q_LENS), out=out, window=window, key_ends=ends)
    assert_written_and_close(out, prefill_attention_ref(*args, 0.2, window=window, key_ends=ends), ATTENTION_TOL)


def test_window_changes_the_answer():
    """The window is not a no-op on these cases (a test that could not fail otherwise)."""
    args = inputs(4, 2, 32, torch.float32)
    assert not torch.allclose(prefill_attention_ref(*args, 0.2, window=5), prefill_attention_ref(*args, 0.2))
    ends = key_ends(Q_LENS, PREFIX_LENS, BLOCKS)
    assert not torch.allclose(prefill_attention_ref(*args, 0.2, key_ends=ends), prefill_attention_ref(*args, 0.2))


@dtype_params
@pytest.mark.parametrize("window", [1, 7, 40, 1000])
@pytest.mark.parametrize("split", [True, False], ids=["split", "one_chunk"])
def test_decode_window_matches_reference(dtype, window, split):
    gen = torch.Generator().manual_seed(window)
    seq_lens = [1, 45, 7, 130, 2] if not split else [130]
    batch = ragged_batch(seq_lens, 2, 32, dtype, gen)
    q = randn(len(seq_lens), 4, 32, dtype=dtype, generator=gen)
    args = (q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.b_req_idx, batch.b_seq_len)
    out = poisoned(tuple(q.shape), dtype)
    decode_attention(*args, 0.15, out=out, window=window)
    want = decode_attention_ref(*args, 0.15, window=window)
    assert_written_and_close(out, want, ATTENTION_TOL)
    if window < 40:
        assert not torch.allclose(want.float(), decode_attention_ref(*args, 0.15).float())


QUANT_CASES = [(torch.int8, 5, False), (torch.int8, 0, True), (torch.int8, 16, True), (torch.float8_e4m3fn, 5, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "cache_dtype, window, blocks", QUANT_CASES, ids=["int8_window", "int8_blocks", "int8_both", "fp8_both"]
)
@pytest.mark.parametrize("pack", [1, 0], ids=["packed", "unpacked"])
def test_prefill_bounded_dequantizes_as_the_reference(dtype, cache_dtype, window, blocks, pack, monkeypatch):
    """The bounded path's masked and unmasked key tiles both apply the cache's scales."""
    force_gqa_pack(monkeypatch, pack)
    q, k_cache, v_cache, *rest = inputs(4, 2, 32, dtype)
    k_cache, v_cache, k_scale, v_scale = quantized(SimpleNamespace(k_cache=k_cache, v_cache=v_cache), cache_dtype)
    args = (q, k_cache, v_cache, *rest, 0.2)
    ends = key_ends(Q_LENS, PREFIX_LENS, BLOCKS) if blocks else None
    bounds = dict(window=window, key_ends=ends, k_scale=k_scale, v_scale=v_scale)
    out = poisoned(tuple(q.shape), dtype)
    prefill_attention(*args, max_q_len=max(Q_LENS), out=out, **bounds)
    assert_written_and_close(out, prefill_attention_ref(*args, **bounds), ATTENTION_TOL)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "one_chunk"])
def test_decode_window_dequantizes_as_the_reference(cache_dtype, split):
    gen = torch.Generator().manual_seed(11)
    seq_lens = [1, 45, 7, 130, 2] if not split else [130]
    batch = ragged_batch(seq_lens, 2, 32, torch.bfloat16, gen)
    q = randn(len(seq_lens), 4, 32, dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, k_scale, v_scale = quantized(batch, cache_dtype)
    args = (q, k_cache, v_cache, batch.req_to_token, batch.b_req_idx, batch.b_seq_len, 0.15)
    out = poisoned(tuple(q.shape), torch.bfloat16)
    decode_attention(*args, out=out, window=7, k_scale=k_scale, v_scale=v_scale)
    want = decode_attention_ref(*args, window=7, k_scale=k_scale, v_scale=v_scale)
    assert_written_and_close(out, want, ATTENTION_TOL)
