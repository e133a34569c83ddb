"""The weight-streaming GEMM on bf16/fp16 operands against the fp32 sum of their exact products, rounded once:
row counts padded to 16/32/64 and past one row tile, N and K off the tile, a masked last step, split-K slices
summed by the second launch, the swapped product, bias, an fp32 out (the row-parallel layers' partial sums), and
strided rows."""

import pytest
import torch
from kernel_cases import DEVICE, assert_written_and_close, poisoned, randn, strided_view

from language.kernels.skinny_gemm import skinny_gemm
from language.kernels.skinny_launches import SkinnyConfig, default_config, launch_for

# The kernel's fp32 sum of the same exact products in another order, then one rounding: about an ulp apart.
SKINNY_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

CONFIGS = [
    None,  # default_config: 64-wide slices, split until ~2 programs per SM
    SkinnyConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=32, block_k=32, split_k=3, num_warps=4, num_stages=3, swap_ab=True),
    SkinnyConfig(block_n=16, block_k=64, split_k=7, num_warps=2, num_stages=2),  # more slices than steps: 5 kept
]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = x.float() @ weight.float().T
    return (y if bias is None else y + bias.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n, k", [(2, 48, 64), (8, 80, 320), (17, 64, 272), (64, 16, 160), (70, 40, 96)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else "x".join(map(str, c)))
def test_skinny_gemm_matches_one_rounded_fp32_sum(dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * n + k)
    x = randn(m, k, dtype=dtype, generator=gen)
    weight = randn(n, k, dtype=dtype, generator=gen) / k**0.5
    bias = randn(n, dtype=dtype, generator=gen) if m % 2 == 0 else None
    out = poisoned((m, n), dtype)
    assert skinny_gemm(x, weight, bias, out=out, config=config) is out
    assert_written_and_close(out, reference(x, weight, bias, dtype), SKINNY_TOL)


@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_gemm_fp32_out_is_the_unrounded_sum_of_strided_rows(split_k):
    """Rows further apart than K (q/k/v views of a fused projection), and the fp32 out of the row-parallel
    layers: the sum before any rounding, with the bias added in fp32."""
    gen = torch.Generator().manual_seed(split_k)
    x = strided_view(randn(5, 300, dtype=torch.bfloat16, generator=gen))
    weight = strided_view(randn(70, 300, dtype=torch.bfloat16, generator=gen), pad=5)
    bias = randn(70, dtype=torch.bfloat16, generator=gen)
    config = SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    out = poisoned((5, 70), torch.float32)
    assert skinny_gemm(x, weight, bias, out_dtype=torch.float32, out=out, config=config) is out
    assert_written_and_close(out, reference(x, weight, bias, torch.float32), SKINNY_TOL)


def test_skinny_default_config_steps_256_bytes_of_bf16_rows():
    """Qwen2-VL-7B's bf16 linears on 132 SMs: 128 columns a step (256 bytes, as the FP8 launches' 256 columns),
    64 where K is not a multiple of 128; the narrow layers split their reduction toward two programs per SM."""
    qkv, gate_up = default_config(8, 4608, 3584, itemsize=2), default_config(64, 37888, 3584, itemsize=2)
    down = default_config(16, 3584, 18944, itemsize=2)
    assert qkv.block_k == 128 and qkv.split_k == 4  # 72 slices x 4 >= 264; 28 steps: 7 a slice
    assert gate_up.split_k == 1
    assert down.block_k == 128 and down.split_k == 5
    assert default_config(8, 3584, 3136, itemsize=2).block_k == 64  # K not a multiple of 128


def test_skinny_gemm_checks_its_operands():
    x = torch.zeros(4, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="x: dtype"):
        skinny_gemm(x.float(), torch.zeros(8, 64, device=DEVICE))  # fp32: not tensor-core 16-bit operands
    with pytest.raises(AssertionError, match="weight: dtype"):
        skinny_gemm(x, torch.zeros(8, 64, device=DEVICE, dtype=torch.float16))
    with pytest.raises(AssertionError, match="weight: shape"):
        skinny_gemm(x, torch.zeros(8, 32, device=DEVICE, dtype=torch.bfloat16))


def test_launch_for_takes_the_measured_table_then_the_first_guess():
    """Measured shapes take their bucket's launch (None: cuBLAS was faster); an unmeasured FP8 shape takes the
    first guess, an unmeasured bf16 one keeps cuBLAS; more rows than the largest bucket never stream."""
    assert launch_for(16, 4608, 3584, itemsize=2) is None  # bf16 qkv: cuBLAS measured faster
    assert launch_for(16, 3584, 3584, itemsize=2) == launch_for(9, 3584, 3584, itemsize=2)  # one bucket: 9-16 rows
    assert launch_for(16, 3584, 3584, itemsize=2) is not None and launch_for(17, 3584, 3584, itemsize=2) is None
    assert launch_for(64, 3584, 18944, itemsize=2) == SkinnyConfig(32, 64, 3, 4, 5)
    assert launch_for(64, 3584, 18944, itemsize=1) == SkinnyConfig(64, 128, 5, 4, 4)
    assert launch_for(8, 512, 256, itemsize=2) is None
    assert launch_for(8, 512, 256, itemsize=1) == default_config(8, 512, 256, itemsize=1)
    assert launch_for(65, 3584, 18944, itemsize=1) is None
