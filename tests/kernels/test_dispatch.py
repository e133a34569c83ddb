"""The package-level entry points pick the Triton kernel on CUDA tensors and the reference elsewhere."""

import pytest
import torch

import language.kernels as kernels
from language.kernels import reference
from language.parallel.layers import linear_fp32


def test_cpu_tensors_take_the_reference_path():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen)
    weight = torch.randn(8, generator=gen)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), reference.rms_norm_ref(x, weight, 1e-6))


def test_reference_path_drops_launch_hints_and_fills_out():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, generator=gen)
    cache = torch.randn(6, 2, 16, generator=gen)
    req_to_token = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    seq_lens = torch.tensor([3, 2], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    result = kernels.decode_attention(q, cache, cache, req_to_token, idx, seq_lens, 0.25, max_seq_len=3, out=out)
    assert result is out
    assert torch.equal(out, reference.decode_attention_ref(q, cache, cache, req_to_token, idx, seq_lens, 0.25))


def test_reference_path_fills_a_pair_of_out_tables():
    positions = torch.arange(5)
    inv_freq = torch.rand(4)
    out = (torch.empty(5, 4), torch.empty(5, 4))
    cos, sin = kernels.rotary_cos_sin(positions, inv_freq, out=out)
    assert cos is out[0] and sin is out[1]
    expected = reference.rotary_cos_sin_ref(positions, inv_freq)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_take_the_triton_path():
    x = torch.randn(3, 8, device="cuda", dtype=torch.float16)
    out = torch.full_like(x, float("nan"))
    assert kernels.rms_norm(x, torch.ones(8, device="cuda", dtype=torch.float16), 1e-6, out=out) is out
    assert not out.isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [2, 17, kernels.SKINNY_MAX_ROWS, kernels.SKINNY_MAX_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_linear_streams_the_weights_for_decode_batches(rows, dtype):
    """2 to SKINNY_MAX_ROWS rows of bf16/fp16 of a shape where the weight-streaming GEMM measured faster (Qwen2-VL-7B's
    down projection) go through it (its sums, bit for bit), more through cuBLAS; both within an ulp of the fp32 sum.
    fp32 partials (`linear_fp32`) take the same path."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 18944, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(3584, 18944, device="cuda", generator=gen) / 140).to(dtype)
    bias = torch.randn(3584, device="cuda", generator=gen).to(dtype)
    streamed = rows <= kernels.SKINNY_MAX_ROWS
    assert kernels.skinny_applies(x, weight) == streamed
    expected = kernels.skinny_gemm(x, weight, bias) if streamed else torch.nn.functional.linear(x, weight, bias)
    got = kernels.linear(x, weight, bias)
    assert torch.equal(got, expected)
    torch.testing.assert_close(got.float(), x.float() @ weight.float().T + bias.float(), atol=3e-2, rtol=1.6e-2)
    partial = linear_fp32(x, weight)
    if streamed:
        assert torch.equal(partial, kernels.skinny_gemm(x, weight, out_dtype=torch.float32))
    torch.testing.assert_close(partial, x.float() @ weight.float().T, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_linear_keeps_cublas_where_it_measured_faster():
    """Qwen2-VL-7B's qkv projection at 16 rows: cuBLAS streamed it faster on the H100, so `kernels.linear` is
    F.linear there, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(16)
    x = torch.randn(16, 3584, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(4608, 3584, device="cuda", generator=gen) / 60).bfloat16()
    assert not kernels.skinny_applies(x, weight)
    assert torch.equal(kernels.linear(x, weight), torch.nn.functional.linear(x, weight))


def test_cpu_linear_is_torchs():
    """Off CUDA nothing streams: `kernels.linear` is F.linear, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(8, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    assert not kernels.skinny_applies(x, weight)
    assert torch.equal(kernels.linear(x, weight), torch.nn.functional.linear(x, weight))
