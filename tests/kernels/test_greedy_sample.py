"""The greedy-sampling kernel against torch on the fp32 upcast: ids equal torch.argmax exactly (ties, ties across
chunk boundaries, rows of -inf, NaN), log-probabilities close to log_softmax gathered, the same bits on every run.

Log-probability tolerance: both sides upcast the same values exactly and compute max - logsumexp in fp32; only the
order of the sum of exponentials differs (chunks, then a tree over chunks, against torch's own order), which moves
logsumexp (magnitude ~ log(V) + max, under ~30 here) by a few fp32 ulps: atol = rtol = 1e-5."""

import pytest
import torch
from kernel_cases import DEVICE, strided_view

from language.kernels.greedy_sample import MIN_CHUNK, chunk_size, greedy_sample
from language.kernels.sampling_reference import greedy_sample_ref

LOGPROB_TOL = {"atol": 1e-5, "rtol": 1e-5}
dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)


def check(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logprobs = greedy_sample(logits)
    want_ids, want_logprobs = greedy_sample_ref(logits)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, want_ids), (ids != want_ids).nonzero().flatten().tolist()
    torch.testing.assert_close(logprobs, want_logprobs, equal_nan=True, **LOGPROB_TOL)
    return ids, logprobs


@dtypes
@pytest.mark.parametrize("rows, vocab", [(1, 5000), (3, 5000), (64, 3001), (70, 9000)])
def test_matches_torch_on_random_strided_rows(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    # Scaled up so that bf16 and fp16 round many logits to equal values: ties everywhere, the maximum's included.
    logits = (torch.randn(rows, vocab, generator=gen) * 6).to(dtype).to(DEVICE)
    check(strided_view(logits, pad=5))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_row_splits_into_several_chunks(rows):
    """The inputs above reach the combining launch with several chunks (a vocabulary not a multiple of them)."""
    assert chunk_size(rows, 5000, DEVICE) < 5000 and 5000 % chunk_size(rows, 5000, DEVICE)


@dtypes
@pytest.mark.parametrize("rows, vocab", [(1, 5000), (70, 20000)])
def test_ties_take_the_first_index_within_and_across_chunks(dtype, rows, vocab):
    chunk = chunk_size(rows, vocab, DEVICE)
    last = vocab - 1
    cases = [
        [chunk - 1, chunk],  # the two sides of a chunk boundary
        [chunk, chunk - 1 + chunk, 2 * chunk - 1],  # the first and last columns of one chunk, and a later one
        [3, chunk + 3, last],  # within the first chunk, and in the ragged last one
        [last],  # only the last column of the ragged last chunk
        [0, last],
    ]
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    for row in range(rows):
        logits[row, cases[row % len(cases)]] = 7.0
    ids, _ = check(logits.to(DEVICE))
    assert ids[: len(cases)].tolist() == [c[0] for c in cases][:rows]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on log(0) and inf - inf
@dtypes
def test_rows_of_minus_infinity(dtype):
    vocab = 5000
    chunk = chunk_size(4, vocab, DEVICE)
    logits = torch.full((4, vocab), float("-inf"), dtype=dtype)
    logits[0, vocab - 1] = -3.0  # one finite logit, in the last chunk: it is certain (log-probability 0)
    logits[1, [chunk - 1, vocab - 1]] = 2.0  # two finite logits in different chunks
    # row 2: all -inf -> torch gives id 0 and NaN (-inf - -inf)
    logits[3] = torch.linspace(-5, 5, vocab).to(dtype)
    logits[3, : vocab // 2] = float("-inf")
    ids, logprobs = check(logits.to(DEVICE))
    assert ids[:3].tolist() == [vocab - 1, chunk - 1, 0]
    assert logprobs[0] == 0.0 and logprobs[2].isnan()
    torch.testing.assert_close(logprobs[1].cpu(), torch.tensor(-0.6931472), **LOGPROB_TOL)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@dtypes
def test_nan_wins_as_torch_argmax_takes_it(dtype):
    vocab = 5000
    chunk = chunk_size(3, vocab, DEVICE)
    logits = torch.zeros((3, vocab), dtype=dtype)
    logits[0, [chunk + 7, vocab - 2]] = float("nan")  # the first NaN wins, though a later chunk holds more
    logits[0, vocab - 1] = 100.0
    logits[1, 5] = float("inf")  # +inf: the id is its index, the log-probability NaN (inf - inf), as torch
    logits[2, [10, vocab - 1]] = float("inf")
    ids, logprobs = check(logits.to(DEVICE))
    assert ids.tolist() == [chunk + 7, 5, 10] and logprobs.isnan().all()


def test_large_logits_do_not_overflow():
    logits = torch.tensor([[1e30, -1e30, 1e30 - 1e24], [80.0, 90.0, 100.0]], device=DEVICE)
    ids, logprobs = check(logits)
    assert ids.tolist() == [0, 2] and logprobs.isfinite().all()


def test_same_bits_on_every_run():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5000, generator=gen) * 4).to(DEVICE)
    first = greedy_sample(logits)
    again = greedy_sample(logits)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_rejects_a_strided_vocabulary_and_integer_logits():
    logits = torch.zeros(4, 2 * MIN_CHUNK, device=DEVICE)
    with pytest.raises(AssertionError, match="contiguous"):
        greedy_sample(logits[:, ::2])
    with pytest.raises(AssertionError, match="dtype"):
        greedy_sample(logits.to(torch.int32))


def test_an_empty_batch_gives_empty_samples():
    ids, logprobs = greedy_sample(torch.zeros(0, 100, device=DEVICE))
    assert ids.shape == (0,) and logprobs.shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_replays_of_a_cuda_graph_give_the_same_bits():
    logits = (torch.randn(64, 152064, device="cuda") * 4).to(torch.bfloat16)
    greedy_sample(logits)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, logprobs = greedy_sample(logits)
    runs = []
    for _ in range(3):
        graph.replay()
        runs.append((ids.clone(), logprobs.clone()))
    want_ids, want_logprobs = greedy_sample_ref(logits)
    assert torch.equal(runs[0][0], want_ids)
    torch.testing.assert_close(runs[0][1], want_logprobs, **LOGPROB_TOL)
    for run_ids, run_logprobs in runs[1:]:
        assert torch.equal(run_ids, runs[0][0]) and torch.equal(run_logprobs, runs[0][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile-only launches exist for compiled kernels")
def test_ids_stay_valid_token_ids_when_launches_only_compile():
    """The engine's warm-up runs whole steps inside compile_only(), where no Triton kernel runs but torch's embedding
    lookup of the sampled ids does: unwritten ids (whatever the allocator's block held) crashed it with a device-side
    assert. They come back as 0 there."""
    from language.kernels.precompile import compile_only

    logits = torch.full((4, 3000), 1.5, device="cuda")
    stale = torch.full((4,), 2**40, dtype=torch.int64, device="cuda")  # what an unwritten block may hold
    del stale
    with compile_only("test"):
        ids, _ = greedy_sample(logits)
    assert ids.tolist() == [0, 0, 0, 0]


def test_compiling_only_is_set_inside_compile_only_alone():
    from language.kernels.precompile import available, compile_only, compiling_only

    assert not compiling_only()
    with compile_only("test"):
        assert compiling_only() == available()
    assert not compiling_only()
