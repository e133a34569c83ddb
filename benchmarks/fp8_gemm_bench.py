"""Per-channel FP8 linears at decode batches of 8 to 64 rows on the GPU (Qwen2-VL-7B's decoder shapes), in one table:
bf16 `torch.matmul`, the activation quantizer then cuBLASLt's row-wise `torch._scaled_mm` (what `fp8_linear` ran),
and the quantizer then our weight-streaming GEMM (language/kernels/fp8_skinny.py) with its default launch and the
best of a grid (output columns per program x columns per step x swapped product x reduction slices, then stages).

Each cell: microseconds per call and the weights' bytes per second as a share of the H100 SXM's 3.35 TB/s (each
call reads another layer's weights, the calls replayed in one CUDA graph, so that none is served from L2). `quant`:
the quantizer alone (what fusing it would save at most). Per M, `x28`: the step's four linears times 28 layers, in
ms. The last lines: the best launch per (shape, M), as `SkinnyConfig`s for skinny_launches.py's measured table, and the
largest difference of the best launch from the torch reference of the same quantized arithmetic.

    python benchmarks/fp8_gemm_bench.py [--rep 10] [--batches 8,16,32,64]
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable

import torch
from triton.testing import do_bench_cudagraph

from language.kernels.fp8_quant import quantize_fp8
from language.kernels.fp8_skinny import fp8_skinny_gemm
from language.kernels.precompile import compile_only
from language.kernels.skinny_launches import SkinnyConfig, default_config, sm_count, split_for
from language.quant.fp8 import fp8_linear_ref, quantize_weight

skinny_gemm = importlib.import_module("language.kernels.skinny_gemm")  # the package rebinds the name
SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
PEAK_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
LAYERS = 28
DEVICE = "cuda"
_COLD_BYTES = 256 << 20  # the FP8 weights one timed replay walks through: five times the H100's 50 MB L2


class Shape:
    """One linear's weights, copied over enough layers that a replay reads them from HBM (bf16: the same bytes
    in half as many copies)."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        copies = max(2, math.ceil(_COLD_BYTES / (n * k)))
        self.bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.fp8 = [quantize_weight(w) for w in self.bf16]
        self.bf16 = self.bf16[: max(2, copies // 2)]

    def fp8_bytes(self) -> int:
        return self.n * self.k + self.n * 4


def grid(
    m: int, shape: Shape, sms: int, block_ks: tuple[int, ...] = (128, 256), wide: bool = False
) -> list[SkinnyConfig]:
    """The first pass, at 4 warps and 4 stages: 32/64 columns per program (and 128 at 4 and 8 warps if `wide`),
    `block_ks` per step, the product as is or swapped, the reduction split for two programs per SM (`split_for`)
    and twice that."""
    configs = []
    slices = ((32, 4), (64, 4), (128, 4), (128, 8)) if wide else ((32, 4), (64, 4))
    for block_n, warps in slices:
        for block_k in block_ks:
            split = split_for(m, shape.n, shape.k, block_n, block_k, sms)
            for split_k in sorted({split, min(2 * split, max(1, shape.k // block_k // 2))}):
                for swap_ab in (False, True):
                    configs.append(SkinnyConfig(block_n, block_k, split_k, warps, 4, swap_ab))
    return configs


def label(c: SkinnyConfig) -> str:
    """columns per program x per step, reduction slices, stages, warps, swapped product."""
    return f"{c.block_n}x{c.block_k} split{c.split_k} st{c.num_stages} w{c.num_warps}{' swap' if c.swap_ab else ''}"


def time_us(calls: list[Callable[[], object]], rep: int) -> float:
    return do_bench_cudagraph(lambda: [call() for call in calls], rep=rep) / len(calls) * 1e3


def scaled_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)


def ours(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, config: SkinnyConfig | None) -> torch.Tensor:
    return fp8_skinny_gemm(*quantize_fp8(x), w, s, config=config)


class Case:
    """One (shape, M): its timings in us, by path; our GEMM's by launch. Of the FP8 weights; subclasses take
    others by overriding the four methods before `run`."""

    BLOCK_KS = (128, 256)  # columns per step in the grid: 128 or 256 bytes of a weight row

    def __init__(self, shape: Shape, m: int, sms: int, wide: bool = False) -> None:
        """wide: 128-column slices in the grid too (--wide)."""
        self.shape, self.m = shape, m
        self.x = torch.randn(m, shape.k, device=DEVICE, dtype=torch.bfloat16)
        self.configs = grid(m, shape, sms, self.BLOCK_KS, wide)
        self.us: dict[str, float] = {}
        self.ours: dict[SkinnyConfig, float] = {}

    def weights(self) -> list:
        return self.shape.fp8

    def call(self, weight, config: SkinnyConfig | None) -> torch.Tensor:
        return ours(self.x, *weight, config)

    def reference(self, weight) -> torch.Tensor:
        return fp8_linear_ref(self.x, *weight)

    def baselines(self) -> dict[str, list[Callable[[], object]]]:
        s = self.shape
        return {
            "bf16": [lambda w=w: torch.matmul(self.x, w.t()) for w in s.bf16],
            "scaled_mm": [lambda w=w, sc=sc: scaled_mm(self.x, w, sc) for w, sc in s.fp8],
            "quant": [lambda: quantize_fp8(self.x)],
        }

    def compile(self) -> None:
        for config in [None, *self.configs, *self._stage_variants(self.configs[0])]:
            self.call(self.weights()[0], config)

    def run(self, rep: int) -> None:
        for name, calls in self.baselines().items():
            self.us[name] = time_us(calls, rep)
        self.us["default"] = self._ours_us(None, rep)
        for config in self.configs:
            self.ours[config] = self._ours_us(config, rep)
        for config in self._stage_variants(self.best()):
            self.ours[config] = self._ours_us(config, rep)

    def best(self) -> SkinnyConfig:
        return min(self.ours, key=self.ours.get)

    def max_rel_error(self) -> float:
        weight = self.weights()[0]
        got = self.call(weight, self.best()).float()
        ref = self.reference(weight).float()
        return ((got - ref).abs().max() / ref.abs().max()).item()

    def _ours_us(self, config: SkinnyConfig | None, rep: int) -> float:
        return time_us([lambda w=w: self.call(w, config) for w in self.weights()], rep)

    @staticmethod
    def _stage_variants(config: SkinnyConfig) -> list[SkinnyConfig]:
        return [config._replace(num_stages=stages) for stages in (3, 5)]


def cell(us: float, nbytes: int) -> str:
    return f"{us:6.1f} {nbytes / (us * 1e-6) / PEAK_BYTES_PER_S:4.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rep", type=int, default=10, help="ms of replays per measurement")
    ap.add_argument("--batches", default="8,16,32,64", help="rows (M) per linear")
    ap.add_argument(
        "--promote",
        default=str(skinny_gemm.FP8_PROMOTE_K),
        help="columns the FP8 tensor cores sum before each fp32 add (0: none, exact products in fp32), one table each",
    )
    ap.add_argument("--wide", action="store_true", help="128-column slices in the grid too (4 and 8 warps)")
    args = ap.parse_args()
    for promote in (int(p) for p in args.promote.split(",")):
        skinny_gemm.FP8_PROMOTE_K = promote
        print(f"-- FP8_PROMOTE_K {promote}")
        run_table(args)


def run_table(args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    sms = sm_count(torch.device(DEVICE))
    print(torch.cuda.get_device_name(), f"({sms} SMs)", "torch", torch.__version__,
          "| us per call, % of 3.35 TB/s of the weights' bytes (bf16: 2 a weight, fp8: 1 + scales)")  # fmt: skip
    shapes = [Shape(*s) for s in SHAPES]
    cases = [Case(shape, m, sms, args.wide) for m in batches for shape in shapes]
    with compile_only("fp8_gemm_bench"):
        for case in cases:
            case.compile()
    torch.cuda.synchronize()
    header = ["bf16 matmul", "quant+_scaled_mm", "quant+ours dflt", "quant+ours best"]
    print(f"{'shape':<8}{'M':>3} " + " ".join(f"{h:>16}" for h in header) + f" {'quant':>6}  best launch")
    totals: dict[int, list[float]] = {m: [0.0] * 4 for m in batches}
    for case in cases:
        case.run(args.rep)
        s, best = case.shape, case.best()
        times = [case.us["bf16"], case.us["scaled_mm"], case.us["default"], case.ours[best]]
        totals[case.m] = [t + u for t, u in zip(totals[case.m], times, strict=True)]
        cells = [cell(times[0], s.n * s.k * 2)] + [cell(t, s.fp8_bytes()) for t in times[1:]]
        print(f"{s.name:<8}{case.m:>3} " + " ".join(f"{c:>16}" for c in cells)
              + f" {case.us['quant']:6.1f}  {label(best)}", flush=True)  # fmt: skip
    summarize(cases, totals, sms, itemsize=1)


def summarize(cases: list[Case], totals: dict[int, list[float]], sms: int, itemsize: int) -> None:
    """The x28 lines, each (shape, M)'s best launch beside `default_config`'s, and the best launches' largest
    difference from the reference."""
    for m, total in totals.items():
        print(f"{'x28':<8}{m:>3} " + " ".join(f"{t * LAYERS / 1e3:>13.3f} ms" for t in total))
    print(f"best launches (skinny_launches.py's measured table, itemsize {itemsize}):")
    for case in cases:
        dflt = default_config(case.m, case.shape.n, case.shape.k, sms, itemsize)
        print(f"  ({case.m}, {case.shape.n}, {case.shape.k}): {case.best()!r},  # default {label(dflt)}")
    print("largest |best - reference| / max |reference|:", f"{max(case.max_rel_error() for case in cases):.2e}")


if __name__ == "__main__":
    main()
