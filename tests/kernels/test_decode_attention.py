import importlib

import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, dtype_params, poisoned, ragged_batch, randn

from language.kernels.decode_attention import (
    _PROGRAMS_PER_SM,
    arrival_counters,
    decode_attention,
    decode_split,
    shortest_chunk,
)
from language.kernels.launch_utils import multiprocessor_count
from language.kernels.reference import decode_attention_ref

# The package rebinds the name to its dispatching function: the module itself, for its launch settings.
decode_module = importlib.import_module("language.kernels.decode_attention")

SEQ_LENS = [1, 45, 7, 130, 2]  # ragged, incl. a 1-token sequence and chunks that end mid-tile
_WIDE_PAIRS_PER_SM = decode_module._WIDE_PAIRS_PER_SM


@pytest.fixture(autouse=True)
def short_chunks(monkeypatch):
    """The interpreter counts 4 SMs, so a handful of sequences would fill its grid and take a full GPU's long chunks
    (shortest_chunk), and few sequences would split: the tests here keep the short chunks unless they ask."""
    monkeypatch.setattr(decode_module, "_WIDE_PAIRS_PER_SM", 1 << 30)


def decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + len(seq_lens) * num_heads + head_dim)
    batch = ragged_batch(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, generator=gen)
    return q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.b_req_idx, batch.b_seq_len


@dtype_params
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (7, 1), (8, 2)], ids=["mha", "gqa7", "gqa4"])
def test_decode_attention_matches_reference(dtype, num_heads, num_kv_heads):
    args = decode_inputs(SEQ_LENS, num_heads, num_kv_heads, 32, dtype)
    out = poisoned(tuple(args[0].shape), dtype)
    assert decode_attention(*args, 32**-0.5, out=out) is out
    assert_written_and_close(out, decode_attention_ref(*args, 32**-0.5), ATTENTION_TOL)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_decode_attention_head_dims(head_dim):
    args = decode_inputs(SEQ_LENS, 4, 2, head_dim, torch.float16)
    assert_written_and_close(decode_attention(*args, 0.1), decode_attention_ref(*args, 0.1), ATTENTION_TOL)


@pytest.mark.parametrize("split", [True, False], ids=["split", "one_chunk"])
def test_decode_attention_single_and_split_chunks(split):
    """Few (sequence, KV head) pairs split each sequence into several key chunks; enough to fill the GPU need only
    one. Both paths."""
    num_kv_heads = 2
    batch_size = 1 if split else -(-_PROGRAMS_PER_SM * multiprocessor_count(DEVICE) // num_kv_heads)
    seq_lens = [(37 * i + 100) % 150 + 1 for i in range(batch_size)]
    num_chunks = decode_split(batch_size, num_kv_heads, max(seq_lens) + 5, DEVICE)
    assert (num_chunks > 1) == split
    args = decode_inputs(seq_lens, num_kv_heads * 2, num_kv_heads, 32, torch.float16)
    out = poisoned(tuple(args[0].shape), torch.float16)
    decode_attention(*args, 0.15, out=out)
    assert_written_and_close(out, decode_attention_ref(*args, 0.15), ATTENTION_TOL)


def test_decode_attention_max_seq_len_hint():
    args = decode_inputs(SEQ_LENS, 4, 2, 32, torch.float32)
    result = decode_attention(*args, 0.2, max_seq_len=max(SEQ_LENS))
    assert_written_and_close(result, decode_attention_ref(*args, 0.2), ATTENTION_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_decode_attention_replays_in_cuda_graph(dtype):
    """Captured once, replayed with new sequence lengths and queries written into the same input buffers."""
    q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len = decode_inputs([130, 130, 130], 8, 2, 128, dtype)
    max_seq_len = req_to_token.shape[1]
    out = torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, 0.1, max_seq_len=max_seq_len, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, 0.1, max_seq_len=max_seq_len, out=out)
    for seq_lens in ([1, 64, 130], [100, 3, 77]):
        b_seq_len.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        expected = decode_attention_ref(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, 0.1)
        assert_written_and_close(out, expected, ATTENTION_TOL)


def test_decode_attention_rejects_dtype_mismatch():
    args = list(decode_inputs([3], 2, 2, 16, torch.float32))
    args[1] = args[1].half()
    with pytest.raises(AssertionError, match="share a dtype"):
        decode_attention(*args, 1.0)


def test_each_sequence_splits_its_own_keys():
    """A grid sized for long sequences (the table's full width, as a captured graph uses) gives short sequences
    chunks of their own length: every split of every sequence, from 1 to hundreds of keys, merges exactly."""
    seq_lens = [1, 3, 64, 65, 400]
    args = decode_inputs(seq_lens, 4, 2, 32, torch.float32)
    assert decode_split(len(seq_lens), 2, args[3].shape[1], DEVICE) > 1
    out = poisoned(tuple(args[0].shape), torch.float32)
    decode_attention(*args, 0.2, out=out)
    assert_written_and_close(out, decode_attention_ref(*args, 0.2), ATTENTION_TOL)


@pytest.fixture
def merge_mode(monkeypatch):
    """Sets the launcher's merge (fused into the last chunk, or a second kernel) and shortest chunk."""

    def use(fused: bool, min_chunk: int | None = None) -> None:
        monkeypatch.setattr(decode_module, "_FUSED_MERGE_MAX_CHUNKS", decode_module._MAX_CHUNKS if fused else 0)
        if min_chunk is not None:
            monkeypatch.setattr(decode_module, "_MIN_CHUNK", min_chunk)

    return use


@pytest.mark.parametrize("fused", [True, False], ids=["fused_merge", "merge_kernel"])
@pytest.mark.parametrize("min_chunk", [16, 64, 1000], ids=["min16", "min64", "min1000"])
def test_merges_and_chunk_floors_match_the_reference(merge_mode, fused, min_chunk):
    """Sequences of 1 to 400 keys, some fitting one chunk (written directly), others split and merged; a floor as
    long as the longest sequence leaves every sequence one chunk."""
    merge_mode(fused, min_chunk)
    seq_lens = [1, 3, 17, 64, 65, 130, 400]
    args = decode_inputs(seq_lens, 8, 2, 32, torch.float32)
    assert decode_split(len(seq_lens), 2, args[3].shape[1], DEVICE) > 1
    out = poisoned(tuple(args[0].shape), torch.float32)
    decode_attention(*args, 0.2, out=out)
    assert_written_and_close(out, decode_attention_ref(*args, 0.2), ATTENTION_TOL)


def test_a_full_grid_takes_long_chunks(monkeypatch):
    """Where the (sequence, KV head) pairs fill the GPU, chunks are at least _MIN_CHUNK_WIDE keys: sequences shorter
    than that take one chunk, longer ones split into fewer chunks than the grid has, and all match the reference."""
    monkeypatch.setattr(decode_module, "_WIDE_PAIRS_PER_SM", _WIDE_PAIRS_PER_SM)
    wide, num_kv_heads = decode_module._MIN_CHUNK_WIDE, 2
    batch_size = max(6, -(-_WIDE_PAIRS_PER_SM * multiprocessor_count(DEVICE) // num_kv_heads))
    assert shortest_chunk(batch_size, num_kv_heads, DEVICE) == wide
    assert shortest_chunk(1, 1, DEVICE) == decode_module._MIN_CHUNK
    lengths = (1, wide - 1, wide, wide + 1, 2 * wide + 76, 2 * wide + 276)
    seq_lens = [lengths[i % len(lengths)] for i in range(batch_size)]
    assert decode_split(batch_size, num_kv_heads, max(seq_lens), DEVICE) > 1
    args = decode_inputs(seq_lens, num_kv_heads * 2, num_kv_heads, 32, torch.float32)
    out = poisoned(tuple(args[0].shape), torch.float32)
    decode_attention(*args, 0.2, out=out)
    assert_written_and_close(out, decode_attention_ref(*args, 0.2), ATTENTION_TOL)


def test_arrival_counters_are_zero_after_each_launch():
    """The fused merge's counters return to zero, so the next launch (or graph replay) starts from zero: launches
    of several batch sizes, splits and windows in a row all match the reference."""
    for seq_lens, window in (([400, 130], 0), ([1, 64, 65, 300, 7], 0), ([400, 130], 50), ([90] * 9, 0)):
        args = decode_inputs(seq_lens, 4, 2, 16, torch.float32)
        out = decode_attention(*args, 0.3, window=window)
        assert_written_and_close(out, decode_attention_ref(*args, 0.3, window=window), ATTENTION_TOL)
        assert not arrival_counters(DEVICE, len(seq_lens) * 2).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the arrival order varies only on a GPU")
def test_fused_merge_is_deterministic():
    """Whichever chunk arrives last merges in chunk order: repeated launches give identical bits."""
    args = decode_inputs([3000, 1200, 700, 5], 28, 4, 128, torch.bfloat16)
    first = decode_attention(*args, 0.1)
    for _ in range(20):
        assert torch.equal(decode_attention(*args, 0.1), first)
