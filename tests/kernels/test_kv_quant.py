"""Quantized KV caches (--llm_kv_type int8kv / fp8kv): the store kernel encodes rows exactly as its torch reference
does, and the prefill and decode kernels, dequantizing inside their tiles, equal the references of the same
quantized arithmetic."""

import importlib

import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, poisoned, ragged_batch, randn, strided_view

from language.kernels.decode_attention import decode_attention
from language.kernels.kv_store import store_kv
from language.kernels.prefill_attention import prefill_attention
from language.kernels.reference import (
    decode_attention_ref,
    decode_kv_ref,
    encode_kv_ref,
    prefill_attention_ref,
    store_kv_ref,
)

prefill_module = importlib.import_module("language.kernels.prefill_attention")
QUANT = [torch.int8, torch.float8_e4m3fn]
quant_params = pytest.mark.parametrize("cache_dtype", QUANT, ids=["int8", "fp8"])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


def empty_scales(cache_dtype: torch.dtype, num_slots: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8: [S, Hk] scales full of NaN (the store writes them); fp8: fixed per-head scales, not all 1."""
    if cache_dtype == torch.int8:
        return poisoned((num_slots, num_kv_heads), torch.float32), poisoned((num_slots, num_kv_heads), torch.float32)
    heads = torch.arange(num_kv_heads, dtype=torch.float32, device=DEVICE)
    return 0.5 + 0.75 * heads, 2.0 - 0.25 * heads


def cache_bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@dtype_params
@quant_params
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim", [(1, 2, 16), (9, 3, 80), (17, 1, 128)])
def test_store_quantizes_as_the_reference(dtype, cache_dtype, num_tokens, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    num_slots = 40
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)
    k = strided_view(randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen) * 3)
    v = strided_view(randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen))
    if num_tokens > 1:
        k[1] = 0  # an all-zero row: scale 0, values 0
    shape = (num_slots, num_kv_heads, head_dim)
    caches = []
    for _ in range(2):
        k_cache = torch.full(shape, 7, dtype=torch.int8, device=DEVICE).to(cache_dtype)  # old content: 7
        v_cache = k_cache.clone()
        caches.append((k_cache, v_cache, *empty_scales(cache_dtype, num_slots, num_kv_heads)))
    store_kv_ref(*caches[0][:2], k, v, slots, k_scale=caches[0][2], v_scale=caches[0][3])
    store_kv(*caches[1][:2], k, v, slots.int(), k_scale=caches[1][2], v_scale=caches[1][3])

    # Bit-exact: the same fp32 arithmetic, and slots not stored keep their old rows (and NaN scales).
    for expected, actual in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(cache_bits(actual), cache_bits(expected), atol=0, rtol=0, equal_nan=True)
    if cache_dtype == torch.int8:
        assert not caches[1][2][slots].isnan().any(), "a scale was left unwritten"


@quant_params
def test_stored_rows_read_back_within_half_a_step(cache_dtype):
    """int8: each value within half its row's step (absmax / 127 / 2); fp8: within e4m3's relative half-ulp (2^-4),
    and values past 448 * scale clamp there."""
    gen = torch.Generator().manual_seed(5)
    x = randn(6, 2, 64, dtype=torch.float32, generator=gen) * 4
    x[0, 0, 0] = 5000.0
    scale = torch.tensor([1.0, 4.0], device=DEVICE) if cache_dtype == torch.float8_e4m3fn else None
    stored, row_scale = encode_kv_ref(x, cache_dtype, scale)
    slots = torch.arange(6, device=DEVICE)
    back = decode_kv_ref(stored, slots, row_scale if row_scale is not None else scale)
    if cache_dtype == torch.int8:
        step = (x.abs().amax(-1) / 127)[..., None]
        assert ((back - x).abs() <= step / 2 + 1e-6).all()
        assert stored.abs().max() == 127
    else:
        assert back[0, 0, 0] == 448.0
        bound = (x.clamp(-448, 448) - x).abs() + x.abs() * 2**-4 + 2**-9 * scale[None, :, None]
        assert ((back - x).abs() <= bound)[1:].all()


def quantized(batch, cache_dtype):
    """The batch's caches as `cache_dtype` stores them, with their scales: (k_cache, v_cache, k_scale, v_scale)."""
    num_slots, num_kv_heads, _ = batch.k_cache.shape
    fp8 = cache_dtype == torch.float8_e4m3fn
    head_scales = empty_scales(cache_dtype, num_slots, num_kv_heads) if fp8 else (None, None)
    k_cache, k_scale = encode_kv_ref(batch.k_cache, cache_dtype, head_scales[0])
    v_cache, v_scale = encode_kv_ref(batch.v_cache, cache_dtype, head_scales[1])
    return (k_cache, v_cache, *head_scales) if fp8 else (k_cache, v_cache, k_scale, v_scale)


@dtype_params
@quant_params
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("seq_lens", [[1, 45, 7, 130, 2], [300]], ids=["ragged", "split"])
def test_decode_attention_dequantizes_as_the_reference(dtype, cache_dtype, num_heads, num_kv_heads, seq_lens):
    gen = torch.Generator().manual_seed(len(seq_lens) + num_heads)
    batch = ragged_batch(seq_lens, num_kv_heads, 32, dtype, gen)
    q = randn(len(seq_lens), num_heads, 32, dtype=dtype, generator=gen)
    k_cache, v_cache, k_scale, v_scale = quantized(batch, cache_dtype)
    args = (q, k_cache, v_cache, batch.req_to_token, batch.b_req_idx, batch.b_seq_len, 32**-0.5)
    out = poisoned(tuple(q.shape), dtype)
    decode_attention(*args, out=out, k_scale=k_scale, v_scale=v_scale)
    assert_written_and_close(out, decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale), ATTENTION_TOL)


@dtype_params
@quant_params
@pytest.mark.parametrize("pack", [1, 0], ids=["packed", "unpacked"])
def test_prefill_attention_over_a_cached_prefix_dequantizes_as_the_reference(dtype, cache_dtype, pack, monkeypatch):
    """Chunked prefill: new queries behind quantized prefix KV of earlier chunks (or of the prefix cache)."""
    default = prefill_module._launch_config
    monkeypatch.setattr(prefill_module, "_launch_config", lambda *a: {**default(*a), "PACK_GQA": pack})
    q_lens, prefix_lens = [3, 1, 20, 16], [13, 30, 0, 5]
    gen = torch.Generator().manual_seed(pack)
    batch = ragged_batch([q + p for q, p in zip(q_lens, prefix_lens, strict=True)], 2, 64, dtype, gen)
    q = randn(sum(q_lens), 6, 64, dtype=dtype, generator=gen)
    b_q_len = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    b_q_start = (torch.cumsum(b_q_len, 0) - b_q_len).int()
    k_cache, v_cache, k_scale, v_scale = quantized(batch, cache_dtype)
    args = (q, k_cache, v_cache, batch.req_to_token, batch.b_req_idx, b_q_start, b_q_len, batch.b_seq_len, 0.125)
    out = poisoned(tuple(q.shape), dtype)
    prefill_attention(*args, max_q_len=max(q_lens), out=out, k_scale=k_scale, v_scale=v_scale)
    assert_written_and_close(out, prefill_attention_ref(*args, k_scale=k_scale, v_scale=v_scale), ATTENTION_TOL)


def test_quantized_attention_is_close_to_unquantized():
    """The quantization itself is small: int8 (per token) and fp8 (scale 1) attention stay near the float cache's."""
    gen = torch.Generator().manual_seed(9)
    batch = ragged_batch([50, 9], 2, 64, torch.float32, gen)
    q = randn(2, 4, 64, dtype=torch.float32, generator=gen)
    args = (batch.req_to_token, batch.b_req_idx, batch.b_seq_len, 0.125)
    exact = decode_attention_ref(q, batch.k_cache, batch.v_cache, *args)
    for cache_dtype, tol in ((torch.int8, 0.02), (torch.float8_e4m3fn, 0.08)):
        k_cache, k_scale = encode_kv_ref(batch.k_cache, cache_dtype, torch.ones(2, device=DEVICE))
        v_cache, v_scale = encode_kv_ref(batch.v_cache, cache_dtype, torch.ones(2, device=DEVICE))
        if cache_dtype != torch.int8:
            k_scale = v_scale = torch.ones(2, device=DEVICE)
        out = decode_attention(q, k_cache, v_cache, *args, k_scale=k_scale, v_scale=v_scale)
        assert (out - exact).abs().max() < tol, cache_dtype


def test_launchers_check_the_scales():
    cache = torch.zeros(8, 2, 16, dtype=torch.int8, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(AssertionError, match="needs k_scale"):
        store_kv(cache, cache.clone(), k, k, slots)
    with pytest.raises(AssertionError, match="k_scale: shape"):
        scale = torch.zeros(2, device=DEVICE)
        store_kv(cache, cache.clone(), k, k, slots, k_scale=scale, v_scale=scale)
    plain = torch.zeros(8, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="takes no scales"):
        scale = torch.zeros(8, 2, device=DEVICE)
        store_kv(plain, plain.clone(), k, k, slots, k_scale=scale, v_scale=scale)
    q = torch.zeros(1, 2, 16, device=DEVICE)
    table = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="k_scale: dtype"):
        scale = torch.zeros(8, 2, dtype=torch.float16, device=DEVICE)
        decode_attention(q, cache, cache, table, one * 0, one, 1.0, k_scale=scale, v_scale=scale)
