"""Batch-1 FP8 linears on the GPU (Qwen2-VL-7B's decoder shapes), in one table: the bf16 GEMV, the quantizer then the
FP8 GEMV (two launches), the FP8 GEMV alone on a row given quantized (by the norm before q/k/v and gate/up), and the
FP8 GEMV that quantizes its row itself (`fp8_gemv_fused`, what `fp8_linear` runs for o and down) over a grid of
launch configurations (rows per program x columns per step x warps), then the LM head (bf16, and FP8 as --quant_type
fp8w8a8 runs it, over the same grid), with 128-column block scales (published FP8 checkpoints) at the end.

Each cell: microseconds per call and the weights' bytes per second as a share of the H100 SXM's 3.35 TB/s (each
call reads another layer's weights, the calls replayed in one CUDA graph, so that none is served from L2). `layer`:
the four linears of one decoder layer; `x28`: the whole step's linears, in ms. The last lines: the best configuration
per shape, and whether the fused GEMV equals the two launches bit for bit on the GPU (it must).

    python benchmarks/fp8_gemv_bench.py [--rep 10]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
from triton.testing import do_bench_cudagraph

from language.kernels.fp8_gemv import GemvConfig, default_config, fp8_gemv, fp8_gemv_fused
from language.kernels.fp8_quant import quantize_fp8
from language.kernels.gemv import gemv
from language.quant.fp8 import expand_block_scales, fp8_linear_ref, quantize_weight

SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
LM_HEAD = ("lm_head", 152064, 3584)
PEAK_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
LAYERS = 28
DEVICE = "cuda"
_COLD_BYTES = 256 << 20  # the weights one timed replay walks through: five times the H100's 50 MB L2


def config_grid() -> list[GemvConfig]:
    """Tiles of 2K to 16K weights (at most 8K with 4 warps: 64 fp32 accumulators a thread)."""
    grid = []
    for block_n in (4, 8, 16, 32):
        for block_k in (256, 512, 1024):
            for warps in (4, 8):
                tile = block_n * block_k
                if 2048 <= tile <= (8192 if warps == 4 else 16384):
                    grid.append(GemvConfig(block_n, block_k, warps))
    return grid


def label(config: GemvConfig) -> str:
    return f"{config.block_n}x{config.block_k}x{config.num_warps}w"


class Shape:
    """One linear's weights, copied over enough layers that a replay reads them from HBM."""

    def __init__(self, name: str, n: int, k: int, scales: str = "channel") -> None:
        """scales: "channel" (FP8 weights, and bf16 ones), "block" (FP8, 128x128 block scales) or "none" (bf16)."""
        self.name, self.n, self.k = name, n, k
        self.x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        self.group = 128 if scales == "block" else None
        self.fp8, self.bf16 = [], []
        for layer in range(max(2, math.ceil(_COLD_BYTES / (n * k)))):
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
            if scales != "block" and (layer < 2 or layer * n * k * 2 < _COLD_BYTES):
                self.bf16.append(w)
            if scales == "channel":
                self.fp8.append(quantize_weight(w))
            elif scales == "block":
                blocks = torch.rand(-(-n // 128), -(-k // 128), device=DEVICE) * 1e-4 + 1e-5
                q = (w.float() * 5000).clamp(-448, 448).to(torch.float8_e4m3fn)
                self.fp8.append((q, expand_block_scales(blocks, 128)[:n].contiguous()))

    def fp8_bytes(self) -> int:
        return self.n * self.k + self.n * 4 * self.fp8[0][1].shape[1]  # weights and their scales


def time_us(calls: list[Callable[[], torch.Tensor]], rep: int) -> float:
    return do_bench_cudagraph(lambda: [call() for call in calls], rep=rep) / len(calls) * 1e3


def bf16_us(shape: Shape, rep: int) -> float:
    return time_us([lambda w=w: gemv(shape.x, w) for w in shape.bf16], rep)


def unfused_us(shape: Shape, rep: int) -> float:
    def call(w, s):
        return fp8_gemv(*quantize_fp8(shape.x, shape.group), w, s)

    return time_us([lambda w=w, s=s: call(w, s) for w, s in shape.fp8], rep)


def given_quantized_us(shape: Shape, rep: int) -> float:
    """The GEMV alone on a row its producer quantized (`QuantizedRows` at batch 1)."""
    x_q, x_scale = quantize_fp8(shape.x, shape.group)
    return time_us([lambda w=w, s=s: fp8_gemv(x_q, x_scale, w, s) for w, s in shape.fp8], rep)


def fused_us(shape: Shape, config: GemvConfig | None, rep: int) -> float:
    return time_us([lambda w=w, s=s: fp8_gemv_fused(shape.x, w, s, config=config) for w, s in shape.fp8], rep)


def bitwise_equal(shape: Shape) -> bool:
    w, s = shape.fp8[0]
    fused = fp8_gemv_fused(shape.x, w, s)
    assert (fused.float() - fp8_linear_ref(shape.x, w, s).float()).abs().max() < 0.05 * fused.abs().max()
    return torch.equal(fused, fp8_gemv(*quantize_fp8(shape.x, shape.group), w, s))


def cell(us: float | None, nbytes: int) -> str:
    return f"{'-':>13}" if us is None else f"{us:6.1f} {nbytes / (us * 1e-6) / PEAK_BYTES_PER_S:5.0%}"


def row(name: str, times: list[float | None], shapes: list[Shape], bf16: bool = False, totals: bool = True) -> None:
    cells = [cell(t, s.n * s.k * 2 if bf16 else s.fp8_bytes()) for t, s in zip(times, shapes, strict=True)]
    total = sum(times) if None not in times and totals else None
    tail = f"{total:7.1f} {total * LAYERS / 1e3:6.3f}" if total is not None else ""
    print(f"{name:<22}" + " ".join(cells) + f"  {tail}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rep", type=int, default=10, help="ms of replays per measurement")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| us per call, % of 3.35 TB/s |",
          ", ".join(f"{name} {n}x{k}" for name, n, k in SHAPES))  # fmt: skip
    shapes = [Shape(*s) for s in SHAPES]
    print(f"{'':<22}" + " ".join(f"{s.name:>13}" for s in shapes) + "    layer    x28")
    row("bf16 gemv", [bf16_us(s, args.rep) for s in shapes], shapes, bf16=True)
    row("fp8 quant+gemv", [unfused_us(s, args.rep) for s in shapes], shapes)
    row("fp8 gemv, row given", [given_quantized_us(s, args.rep) for s in shapes], shapes)
    row("fp8 fused default", [fused_us(s, None, args.rep) for s in shapes], shapes)
    results = {}
    for config in config_grid():
        results[config] = [fused_us(s, config, args.rep) for s in shapes]
        row(f"  fused {label(config)}", results[config], shapes)
    best = [min(results, key=lambda c: results[c][i]) for i in range(len(shapes))]
    row("fp8 fused best", [results[c][i] for i, c in enumerate(best)], shapes)
    print(f"{'  best config':<22}" + " ".join(f"{label(c):>13}" for c in best))
    print(f"{'  default config':<22}" + " ".join(f"{label(default_config(s.k, n=s.n)):>13}" for s in shapes))
    print("bitwise fused == quant+gemv:", ", ".join(f"{s.name} {bitwise_equal(s)}" for s in shapes))
    del shapes
    lm_head(args.rep)
    blocks = [Shape(*s, scales="block") for s in SHAPES]
    row("block128 quant+gemv", [unfused_us(s, args.rep) for s in blocks], blocks)
    row("block128 fused", [fused_us(s, None, args.rep) for s in blocks], blocks)
    print("bitwise fused == quant+gemv (block128):", ", ".join(f"{s.name} {bitwise_equal(s)}" for s in blocks))


def lm_head(rep: int) -> None:
    """The LM head (once a step, quantized under --quant_type fp8w8a8): bf16 against FP8, over the same grid."""
    head = Shape(*LM_HEAD)
    print(f"lm_head {LM_HEAD[1]}x{LM_HEAD[2]}")
    row("  bf16 gemv", [bf16_us(head, rep)], [head], bf16=True, totals=False)
    row("  fp8 quant+gemv", [unfused_us(head, rep)], [head], totals=False)
    row("  fp8 fused default", [fused_us(head, None, rep)], [head], totals=False)
    times = {}
    for config in config_grid():
        times[config] = fused_us(head, config, rep)
        row(f"  fused {label(config)}", [times[config]], [head], totals=False)
    best = min(times, key=times.get)
    print(f"  best config {label(best)}, default config {label(default_config(head.k, n=head.n))}")
    print("  bitwise fused == quant+gemv:", bitwise_equal(head))


if __name__ == "__main__":
    main()
