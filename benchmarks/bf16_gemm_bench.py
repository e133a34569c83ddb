"""bf16 linears at decode batches of 8 to 64 rows on the GPU (Qwen2-VL-7B's decoder shapes): `torch.matmul`
(cuBLAS, what `kernels.linear` ran for 2+ rows) against our weight-streaming GEMM (language/kernels/skinny_gemm.py)
with its default launch and the best of a grid (output columns per program x 64/128 columns per step x swapped
product x reduction slices, then stages), timed as benchmarks/fp8_gemm_bench.py times them.

Each cell: microseconds per call and the weights' bytes per second as a share of the H100 SXM's 3.35 TB/s (each
call reads another copy of the weights, the calls replayed in one CUDA graph, so that none is served from L2). Per
M, `x28`: the step's four linears times 28 layers, in ms. The last lines: the best launch per (shape, M), as
`SkinnyConfig`s for skinny_gemm.default_config, and the largest difference of the best launch from the fp32 sum
(the reference).

    python benchmarks/bf16_gemm_bench.py [--rep 10] [--batches 8,16,32,64] [--lm_head]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.fp8_gemm_bench import DEVICE, SHAPES, Case, Shape, cell, label, summarize
from language.kernels.precompile import compile_only
from language.kernels.skinny_gemm import skinny_gemm
from language.kernels.skinny_launches import SkinnyConfig, sm_count

LM_HEAD = ("lm_head", 152064, 3584)  # Qwen2-VL's vocabulary: `kernels.linear` runs it too, not in the x28 sum


class Bf16Case(Case):
    BLOCK_KS = (64, 128)  # 128 or 256 bytes of a weight row per step, as the FP8 grid's

    def weights(self) -> list[torch.Tensor]:
        return self.shape.bf16

    def call(self, weight: torch.Tensor, config: SkinnyConfig | None) -> torch.Tensor:
        return skinny_gemm(self.x, weight, config=config)

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        return self.x.float() @ weight.float().T

    def baselines(self) -> dict[str, list[Callable[[], object]]]:
        return {"bf16": [lambda w=w: torch.matmul(self.x, w.t()) for w in self.shape.bf16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rep", type=int, default=10, help="ms of replays per measurement")
    ap.add_argument("--batches", default="8,16,32,64", help="rows (M) per linear")
    ap.add_argument("--lm_head", action="store_true", help=f"also the LM head {LM_HEAD[1]} x {LM_HEAD[2]}")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sms = sm_count(torch.device(DEVICE))
    print(torch.cuda.get_device_name(), f"({sms} SMs)", "torch", torch.__version__,
          "| us per call, % of 3.35 TB/s of the weights' bytes")  # fmt: skip
    shapes = [Shape(*s) for s in SHAPES + ([LM_HEAD] if args.lm_head else [])]
    cases = [Bf16Case(shape, m, sms) for m in batches for shape in shapes]
    with compile_only("bf16_gemm_bench"):
        for case in cases:
            case.compile()
    torch.cuda.synchronize()
    header = ["matmul (cuBLAS)", "ours dflt", "ours best"]
    print(f"{'shape':<8}{'M':>3} " + " ".join(f"{h:>16}" for h in header) + f" {'speedup':>8}  best launch")
    totals: dict[int, list[float]] = {m: [0.0] * 3 for m in batches}
    for case in cases:
        case.run(args.rep)
        s, best = case.shape, case.best()
        times = [case.us["bf16"], case.us["default"], case.ours[best]]
        if s.name != LM_HEAD[0]:
            totals[case.m] = [t + u for t, u in zip(totals[case.m], times, strict=True)]
        cells = [cell(t, s.n * s.k * 2) for t in times]
        print(f"{s.name:<8}{case.m:>3} " + " ".join(f"{c:>16}" for c in cells)
              + f" {times[0] / times[1]:7.2f}x  {label(best)}", flush=True)  # fmt: skip
    summarize(cases, totals, sms, itemsize=2)


if __name__ == "__main__":
    main()
