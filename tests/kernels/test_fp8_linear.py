"""The FP8 kernels against the torch reference of the same quantized arithmetic (language/quant/fp8.py): the GEMV,
the block-scaled GEMM and the few-row GEMM take the same quantized operands, so they differ from it only by the
order of the fp32 sums (and, for the few-row GEMM on a GPU, by the tensor cores' partial sums); the activation
quantizer equals the reference: the same scales and the same e4m3 values; the GEMV that quantizes its row itself
equals the quantizer then the GEMV, bit for bit, in every launch configuration."""

import pytest
import torch
from kernel_cases import DEVICE, poisoned

from language.kernels import fp8_gemv as gemv_module
from language.kernels.fp8_gemm import fp8_gemm
from language.kernels.fp8_gemv import GemvConfig, fp8_gemv, fp8_gemv_fused
from language.kernels.fp8_quant import FP8_DTYPE, QuantizedRows, quantize_fp8
from language.kernels.fp8_skinny import fp8_skinny_gemm
from language.kernels.skinny_launches import SKINNY_MAX_ROWS, SkinnyConfig, default_config
from language.quant.fp8 import (
    dequantize,
    expand_block_scales,
    fp8_linear,
    fp8_linear_ref,
    quantize_rows_ref,
    quantize_weight,
)

# The kernels' fp32 sums of the same products, in another order, then one rounding to the output dtype.
FP8_GEMM_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2)}
# On the GPU the few-row GEMM lets the FP8 tensor cores sum 128 products at a time in their ~14-bit accumulator
# (skinny_gemm.FP8_PROMOTE_K): each output within this share of the sum of its products' magnitudes.
FP8_TENSOR_CORE_SUM = 2.0**-12


def _operands(m: int, n: int, k: int, group: int | None, seed: int):
    """Quantized x [m, k] and weight [n, k] with their scales; group None: per token and per channel, else the
    weight's scales per 128-row block (a published checkpoint's), expanded per row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    w = torch.randn(n, k, generator=gen) / k**0.5
    if group is None:
        w_q, w_scale = quantize_weight(w)
    else:
        blocks = torch.rand(-(-n // 128), -(-k // group), generator=gen) * 1e-3 + 1e-4
        w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
        w_scale = expand_block_scales(blocks, 128)[:n]
    x_q, x_scale = quantize_rows_ref(x, group)
    return x, x_q, x_scale, w_q, w_scale


def _expected(x_q, x_scale, w_q, w_scale, bias, dtype):
    y = dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).T
    return (y if bias is None else y + bias.float()).to(dtype)


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, k, group", [(7, 64, None), (40, 600, None), (130, 256, 128), (33, 300, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv_matches_the_reference(dtype, n, k, group, with_bias):
    _, x_q, x_scale, w_q, w_scale = _operands(1, n, k, group, seed=n * k)
    bias = torch.randn(n).to(dtype) if with_bias else None
    expected = _expected(x_q, x_scale, w_q, w_scale, bias, dtype)
    out = poisoned((1, n), dtype)
    got = fp8_gemv(*_to(DEVICE, x_q, x_scale, w_q, w_scale, bias), out_dtype=dtype, out=out)
    assert got is out
    atol, rtol = FP8_GEMM_TOL[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k, group", [(3, 48, 64, None), (20, 130, 256, 128), (17, 64, 300, 128)])
def test_fp8_gemm_matches_the_reference(dtype, m, n, k, group):
    _, x_q, x_scale, w_q, w_scale = _operands(m, n, k, group, seed=m * n + k)
    bias = torch.randn(n).to(dtype)
    expected = _expected(x_q, x_scale, w_q, w_scale, bias, dtype)
    got = fp8_gemm(*_to(DEVICE, x_q, x_scale, w_q, w_scale, bias), out_dtype=dtype)
    atol, rtol = FP8_GEMM_TOL[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)


SKINNY_CONFIGS = [
    None,  # default_config: 64-wide slices, split until ~2 programs per SM
    SkinnyConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=32, block_k=32, split_k=3, num_warps=4, num_stages=3, swap_ab=True),
    SkinnyConfig(block_n=16, block_k=64, split_k=7, num_warps=2, num_stages=2),  # more slices than steps: 5 kept
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k", [(2, 48, 64), (8, 80, 320), (17, 64, 272), (64, 16, 160), (70, 40, 96)])
@pytest.mark.parametrize("config", SKINNY_CONFIGS, ids=lambda c: "default" if c is None else "x".join(map(str, c)))
def test_fp8_skinny_gemm_matches_the_reference(dtype, m, n, k, config):
    """Rows padded to 16/32/64 (and two row tiles at 70), N and K multiples of 16 that are not of the tile (K = 272:
    a masked last step), split-K slices summed by the second launch, the swapped product; bias and out dtype."""
    _, x_q, x_scale, w_q, w_scale = _operands(m, n, k, None, seed=m * n + k)
    bias = torch.randn(n).to(dtype) if m % 2 == 0 else None
    expected = _expected(x_q, x_scale, w_q, w_scale, bias, dtype)
    out = poisoned((m, n), dtype)
    got = fp8_skinny_gemm(*_to(DEVICE, x_q, x_scale, w_q, w_scale, bias), out_dtype=dtype, out=out, config=config)
    assert got is out
    atol, rtol = FP8_GEMM_TOL[dtype]
    if DEVICE.type == "cuda":  # the tensor cores' partial sums: within a share of the products' magnitudes
        magnitudes = dequantize(x_q, x_scale).abs() @ dequantize(w_q, w_scale).abs().T
        error = (got.cpu().float() - expected.float()).abs()
        assert (error <= FP8_TENSOR_CORE_SUM * magnitudes + atol + rtol * expected.float().abs()).all(), error.max()
    else:
        torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)


def test_fp8_skinny_default_config_splits_narrow_layers():
    """Qwen2-VL-7B's linears on 132 SMs: the narrow ones (56-72 slices of 64 columns) split their reduction toward
    two programs per SM, keeping 4 steps a slice; gate_up's 592 slices need no split."""
    qkv, gate_up, down = default_config(8, 4608, 3584), default_config(64, 37888, 3584), default_config(16, 3584, 18944)
    assert qkv.split_k == 3 and qkv.block_k == 256  # 14 steps of 256: 4 a slice at least
    assert gate_up.split_k == 1
    assert down.split_k == 5 and down.block_k == 256  # 56 slices x 5 >= 264
    assert default_config(8, 3584, 3200).block_k == 128  # K not a multiple of 256


@pytest.mark.skipif(DEVICE.type != "cuda", reason="fp8_linear runs the reference itself off CUDA")
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["x_dtype", "fp32"])
@pytest.mark.parametrize("m", [1, 2, 8, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1])
def test_fp8_linear_follows_the_reference_on_each_path(m, out_dtype):
    """On the GPU, each row count's path (the fused GEMV, the weight-streaming GEMM up to SKINNY_MAX_ROWS rows,
    cuBLASLt's above), with the row-parallel layers' fp32 out."""
    x, _, _, w_q, w_scale = _operands(m, 96, 320, None, seed=m)
    x, w_q, w_scale, bias = _to(DEVICE, x.to(torch.bfloat16), w_q, w_scale, torch.randn(96).to(torch.bfloat16))
    got = fp8_linear(x, w_q, w_scale, bias, out_dtype)
    expected = fp8_linear_ref(x.cpu(), w_q.cpu(), w_scale.cpu(), bias.cpu(), out_dtype)
    assert got.dtype == expected.dtype
    atol, rtol = FP8_GEMM_TOL[torch.bfloat16]  # cuBLASLt's bf16 out, widened, for fp32 above SKINNY_MAX_ROWS
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["x_dtype", "fp32"])
@pytest.mark.parametrize("m", [1, 8, SKINNY_MAX_ROWS + 1])
def test_fp8_linear_takes_rows_its_producer_quantized(m, out_dtype):
    """Rows quantized per token beforehand (by a norm or activation kernel): on each path (the GEMV of a quantized
    row, the weight-streaming GEMM, cuBLASLt with the bias in its epilogue) the result of the float rows, bit for
    bit, in the rows' dtype by default."""
    x, _, _, w_q, w_scale = _operands(m, 96, 320, None, seed=m + 1)
    x, w_q, w_scale, bias = _to(DEVICE, x.to(torch.bfloat16), w_q, w_scale, torch.randn(96).to(torch.bfloat16))
    got = fp8_linear(QuantizedRows(*quantize_fp8(x), x.dtype), w_q, w_scale, bias, out_dtype)
    assert torch.equal(got, fp8_linear(x, w_q, w_scale, bias, out_dtype))
    assert got.dtype == (out_dtype or x.dtype)


def test_fp8_linear_takes_quantized_rows_for_per_channel_weights_only():
    _, x_q, x_scale, w_q, w_scale = _operands(2, 130, 256, 128, seed=5)
    with pytest.raises(AssertionError, match="per-channel"):
        fp8_linear(QuantizedRows(x_q, x_scale[:, :1], torch.bfloat16), w_q, w_scale)


def test_fp8_skinny_gemm_takes_per_channel_scales_only():
    _, x_q, x_scale, w_q, w_scale = _operands(4, 32, 256, 128, seed=5)
    with pytest.raises(AssertionError, match="per-channel"):
        fp8_skinny_gemm(*_to(DEVICE, x_q, x_scale, w_q, w_scale))


@pytest.mark.parametrize("m, k, group", [(1, 64, None), (5, 600, None), (4, 300, 128), (3, 256, 128)])
@pytest.mark.parametrize("magnitude", [3.0, 1e-3], ids=["normal", "tiny"])
def test_quantize_fp8_matches_the_reference(m, k, group, magnitude):
    """Every e4m3 binade is met (the scale maps each group's largest value to 448), subnormals included; `tiny`
    inputs check that the scales follow small activations."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen) * magnitude * torch.logspace(-4, 0, k)[torch.randperm(k, generator=gen)]
    x = x.to(torch.bfloat16)
    x[0, :] = 0  # an all-zero row: its values stay 0
    q_ref, s_ref = quantize_rows_ref(x, group)
    q, s = quantize_fp8(x.to(DEVICE), group)
    torch.testing.assert_close(s.cpu(), s_ref, atol=0, rtol=1e-6)
    assert torch.equal(q.cpu().float(), q_ref.float())


FUSED_CASES = [(7, 64, None), (40, 600, None), (24, 1024, None), (5, 9000, None), (130, 256, 128), (33, 300, 128)]
CONFIGS = [None, GemvConfig(block_n=16, block_k=128, num_warps=4), GemvConfig(block_n=4, block_k=1024, num_warps=8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, k, group", FUSED_CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else "x".join(map(str, c)))
def test_fused_fp8_gemv_equals_the_unfused_path(dtype, n, k, group, config):
    """The row quantized inside the GEMV: the same result as quantize_fp8 then fp8_gemv with the same launch, bit for
    bit (a row given quantized takes another launch by default, whose fp32 sums may differ in the last bit), and the
    reference's up to the order of the sums. Values over four decades meet every e4m3 binade, subnormals included;
    a zero group (block case: the columns of the first group) quantizes to zeros."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen) * 3 * torch.logspace(-4, 0, k)[torch.randperm(k, generator=gen)]
    x = x.to(dtype)
    if group is not None:
        x[0, :group] = 0
    _, _, _, w_q, w_scale = _operands(1, n, k, group, seed=n * k)
    bias = torch.randn(n).to(dtype)
    x, w_q, w_scale, bias = _to(DEVICE, x, w_q, w_scale, bias)
    out = poisoned((1, n), dtype)
    fused = fp8_gemv_fused(x, w_q, w_scale, bias, out=out, config=config)
    assert fused is out
    launch = config or gemv_module.default_config(k, n=n)
    unfused = fp8_gemv(*quantize_fp8(x, group), w_q, w_scale, bias, out_dtype=dtype, config=launch)
    assert torch.equal(fused, unfused), (fused - unfused).abs().max()
    atol, rtol = FP8_GEMM_TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16]
    expected = fp8_linear_ref(x.cpu(), w_q.cpu(), w_scale.cpu(), bias.cpu(), dtype)
    torch.testing.assert_close(fused.cpu(), expected, atol=atol, rtol=rtol)


def test_fused_fp8_gemv_of_a_zero_row_is_its_bias():
    _, _, _, w_q, w_scale = _operands(1, 24, 64, None, seed=3)
    bias = torch.randn(24).to(torch.bfloat16)
    x, w_q, w_scale, bias = _to(DEVICE, torch.zeros(1, 64, dtype=torch.bfloat16), w_q, w_scale, bias)
    assert torch.equal(fp8_gemv_fused(x, w_q, w_scale, bias), bias[None])


def test_reference_is_the_dequantized_product():
    """The reference's arithmetic, spelled out: per-token activation scales, per-channel weight scales."""
    x, x_q, x_scale, w_q, w_scale = _operands(4, 24, 64, None, seed=1)
    y = fp8_linear_ref(x, w_q, w_scale)
    manual = (x_q.float() * x_scale) @ (w_q.float() * w_scale).T
    torch.testing.assert_close(y, manual)
    assert (y - x @ (w_q.float() * w_scale).T).abs().max() < 0.1 * y.abs().max()  # and close to unquantized x's


def test_fp8_kernels_check_their_operands():
    _, x_q, x_scale, w_q, w_scale = _operands(2, 16, 64, None, seed=2)
    x_q, x_scale, w_q, w_scale = _to(DEVICE, x_q, x_scale, w_q, w_scale)
    with pytest.raises(AssertionError, match="x_q"):
        fp8_gemv(x_q, x_scale, w_q, w_scale)  # two rows
    with pytest.raises(AssertionError, match="weight"):
        fp8_gemm(x_q, x_scale, w_q.float(), w_scale)  # not fp8
    with pytest.raises(AssertionError, match="x_scale"):
        fp8_gemm(x_q, x_scale[:1], w_q, w_scale)
    with pytest.raises(AssertionError, match="x: dtype"):
        fp8_gemv_fused(x_q[:1], w_q, w_scale)  # already quantized
    with pytest.raises(AssertionError, match="x: shape"):
        fp8_gemv_fused(x_q.float(), w_q, w_scale)  # two rows
    wide_groups = torch.ones(16, 2, device=DEVICE)  # two groups of 1024 columns: more than one step quantizes
    with pytest.raises(AssertionError, match="groups too wide"):
        fp8_gemv_fused(torch.ones(1, 2048, device=DEVICE), w_q.repeat(1, 32), wide_groups)
