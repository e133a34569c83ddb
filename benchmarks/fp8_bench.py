"""FP8 linear layers on the GPU (Qwen2-VL-7B's decoder shapes), against bf16: which path each batch size should take.

- batch 1 (decode): our FP8 GEMV (activation quantizer + GEMV, language/kernels/fp8_gemv.py) against the bf16 GEMV
  and against quantizer + cuBLASLt's row-wise `torch._scaled_mm` at M = 1;
- batches of 16 to 4096 rows: `fp8_linear` as dispatched (up to 64 rows our weight-streaming GEMM, beyond that
  quantizer + `_scaled_mm` per channel) against bf16 cuBLAS, quantizer + `_scaled_mm`, and our Triton FP8 GEMM with
  per-channel scales (benchmarks/fp8_gemm_bench.py tunes the few-row GEMM);
- block-wise scales (published Qwen3-VL-FP8 checkpoints, 128-column groups): our Triton block GEMM against
  `_scaled_mm` with 1x128 activation and 128x1 (per-row) weight scales, where this torch has it (CUDA >= 12.9, sm90).

Each line: the time per layer (every layer's weight its own, all of them replayed in one CUDA graph, as in a step),
and the largest difference from the torch reference of the same quantized arithmetic.

    python benchmarks/fp8_bench.py [--batches 1,16,64,256,1024,4096]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from language.kernels.fp8_gemm import fp8_gemm
from language.kernels.fp8_gemv import fp8_gemv
from language.kernels.fp8_quant import quantize_fp8
from language.kernels.gemv import gemv
from language.quant.fp8 import expand_block_scales, fp8_linear, fp8_linear_ref, quantize_weight

SHAPES = [  # (name, N, K, layers): one weight per layer so that none is served from L2
    ("qkv_proj", 4608, 3584, 28),
    ("o_proj", 3584, 3584, 28),
    ("gate_up_proj", 37888, 3584, 28),
    ("down_proj", 3584, 18944, 28),
]


def per_layer_us(fn, layers: list) -> float:
    return do_bench_cudagraph(lambda: [fn(*layer) for layer in layers], rep=100) / len(layers) * 1e3


def blockwise_scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`_scaled_mm` with 1x128 activation scales and per-row weight scales per 128 columns (BlockWise1x128 on both
    sides): both scale tensors outer-dim-major, as torch's blockwise path wants them."""
    x_q, x_scale = quantize_fp8(x, 128)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale.t().contiguous().t(), scale_b=w_scale.t(),
                            out_dtype=torch.bfloat16)  # fmt: skip


def triton_block(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x, 128)
    return fp8_gemm(x_q, x_scale, w_q, w_scale)


def triton_channel(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return fp8_gemm(x_q, x_scale, w_q, w_scale)


def gemv_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return fp8_gemv(x_q, x_scale, w_q, w_scale)


def rowwise_scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)


def line(label: str, fn, layers: list, ref: torch.Tensor, base_us: float | None) -> float | None:
    try:
        err = (fn(*layers[0]).float() - ref).abs().max().item()
        us = per_layer_us(fn, layers)
    except RuntimeError as e:  # a path this torch or GPU lacks
        print(f"    {label:<34} unavailable: {str(e).splitlines()[0][:100]}", flush=True)
        return None
    speed = f" | {base_us / us:4.2f}x bf16" if base_us else ""
    print(f"    {label:<34} {us:8.2f} us{speed} | max|diff| vs reference {err:.1e}", flush=True)
    return us


def bench_shape(name: str, n: int, k: int, layers: int, m: int) -> None:
    print(f"{name} [{m}, {k}] x [{n}, {k}]", flush=True)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    bf16 = [(x, w) for w in weights]
    base_us = line("bf16 " + ("gemv" if m == 1 else "cuBLAS"), gemv if m == 1 else F.linear, bf16,
                   F.linear(x.float(), weights[0].float()), None)  # fmt: skip
    channel = [(x, *quantize_weight(w)) for w in weights]
    ref = fp8_linear_ref(x, *channel[0][1:]).float()
    line("fp8_linear (as dispatched)", fp8_linear, channel, ref, base_us)
    if m == 1:
        line("quantize + fp8 GEMV", gemv_fp8, channel, ref, base_us)
    line("quantize + _scaled_mm row-wise", rowwise_scaled_mm, channel, ref, base_us)
    line("quantize + Triton GEMM per channel", triton_channel, channel, ref, base_us)
    blocks = [torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-4 + 1e-5 for _ in weights]
    block = [(x, (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
              expand_block_scales(s, 128)[:n].contiguous()) for s in blocks]  # fmt: skip
    ref = fp8_linear_ref(x, *block[0][1:]).float()
    line("block: fp8_linear (as dispatched)", fp8_linear, block, ref, base_us)
    line("block: quantize + Triton block GEMM", triton_block, block, ref, base_us)
    line("block: quantize + _scaled_mm 1x128", blockwise_scaled_mm, block, ref, base_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256,1024,4096")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda)
    for m in (int(b) for b in args.batches.split(",")):
        for name, n, k, layers in SHAPES:
            bench_shape(name, n, k, layers if m <= 64 else 4, m)


if __name__ == "__main__":
    main()
