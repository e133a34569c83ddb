import pytest
import torch
from kernel_cases import ATTENTION_TOL, DEVICE, assert_written_and_close, dtype_params, poisoned, ragged_batch, randn

from language.kernels.decode_attention import _PROGRAMS_PER_SM, decode_attention, decode_split
from language.kernels.launch_utils import multiprocessor_count
from language.kernels.reference import decode_attention_ref

SEQ_LENS = [1, 45, 7, 130, 2]  # ragged, incl. a 1-token sequence and chunks that end mid-tile


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
