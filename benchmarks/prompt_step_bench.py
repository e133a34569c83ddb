"""The engine's eager prompt steps on a GPU: host time to launch one, device time to run it, and where the device
time goes, with the GPU to itself and time-sliced with another process (as the vision tower shares it in serving).

    python benchmarks/prompt_step_bench.py --model_dir /tmp/q2vl7b            # any family's LM, random weights
    python benchmarks/prompt_step_bench.py --model_dir /tmp/q2vl7b --chunks 4096 --profile --top 25
    python benchmarks/prompt_step_bench.py --model_dir /tmp/q2vl7b --compare_eager  # piecewise graphs or not

Each step is a prompt chunk of N tokens beside `--decode` running requests' decode rows (a mixed step, as under
load), launched with the device idle: `launch ms` is EngineCore.step() from its call to its return (schedule,
stage, pack, upload, and enqueueing every kernel), `step ms` from the call to the step's end on the device. With
`--hog`, a second process keeps the GPU busy with bf16 matmuls meanwhile, so the driver time-slices the two
contexts; whether the launch then takes longer tells host overhead from back-pressure of the device."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from benchmarks.profile_table import print_kernel_table
from language.config import EngineConfig
from language.engine import EngineCore
from language.request import Request
from language.sampling_params import SamplingParams


def _hog(stop: mp.Event, ready: mp.Event) -> None:
    """Another CUDA context with work queued all the time: ~2 ms matmuls, a few in flight."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ready.set()
    while not stop.is_set():
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()


def _ids(core: EngineCore, seed: int, n: int) -> list[int]:
    """n ordinary token ids (below any special ones, which sit at the top of the vocabularies here)."""
    span = min(900, core.model_info.vocab_size // 2)
    return [1 + (seed + j) % span for j in range(n)]


def _sync(core: EngineCore) -> None:
    if core.model_info.device.type == "cuda":
        torch.cuda.synchronize()


def _running(core: EngineCore, count: int, prompt_len: int) -> list[Request]:
    """`count` requests past their prompts, decoding."""
    params = SamplingParams(max_new_tokens=4000, ignore_eos=True)  # the KV cache holds them all: none waits
    reqs = [Request(f"d{i}", _ids(core, i, prompt_len), params) for i in range(count)]
    for r in reqs:
        core.add_request(r)
    while core.stats().waiting or any(r.prefilling for r in reqs):
        core.step()
    return reqs


def time_prompt_steps(core: EngineCore, chunk: int, repeats: int) -> tuple[list[float], list[float]]:
    """(launch ms, step ms) of `repeats` steps that each prefill a new `chunk`-token prompt beside the decode rows."""
    launch, step = [], []
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i in range(repeats):
        core.step()  # a decode step: the timed one collects it at once, the device idle
        _sync(core)
        core.add_request(Request(f"p{chunk}-{i}-{time.monotonic_ns()}", _ids(core, 7 + i, chunk), params))
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        _sync(core)
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        step.append((t2 - t0) * 1e3)
    return launch, step


def profile_prompt_step(core: EngineCore, chunk: int, top: int) -> None:
    """Device time per kernel of one `chunk`-token mixed step (5 steps averaged)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            core.add_request(Request(f"prof{chunk}-{i}", _ids(core, 7 + i, chunk), params))
            core.step()
            core.step()
        torch.cuda.synchronize()
    print_kernel_table(prof, steps, top, f"per {chunk}-token mixed step and the decode step after it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True, help="a checkpoint folder (only config.json is read: dummy weights)")
    ap.add_argument("--chunks", default="64,512,1024,2048,4096", help="prompt tokens of the timed steps")
    ap.add_argument("--decode", type=int, default=32, help="running requests decoding beside each chunk")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no_hog", action="store_true", help="skip the time-sliced half")
    ap.add_argument("--compare_eager", action="store_true", help="each arm also with the piecewise graphs set aside")
    ap.add_argument("--profile", action="store_true", help="then each chunk's kernels (device time)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default="auto", help="cuda (auto) or cpu (a check of this script on a tiny model)")
    ap.add_argument(
        "--piecewise_cuda_graph_max_tokens",
        type=int,
        default=EngineConfig.piecewise_cuda_graph_max_tokens,
        help="steps of up to this many tokens replay piecewise graphs (the server's flag); 0: eager",
    )
    ap.add_argument("--quant_type", default="none", help="the engine's --quant_type (fp8w8a8: FP8 linears)")
    ap.add_argument(
        "--disable_fp8_fused_quant", action="store_true", help="the engine's: each FP8 linear quantizes its own input"
    )
    args = ap.parse_args()
    cfg = EngineConfig(
        model_dir=args.model_dir, max_total_token_num=200_000, load_format="dummy", device=args.device,
        prefix_cache=False,  # every prompt prefilled in full (the prompts here repeat)
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens, quant_type=args.quant_type,
        fp8_fused_quant=not args.disable_fp8_fused_quant,
    )  # fmt: skip
    core = EngineCore(cfg)
    _running(core, args.decode, 1000)
    chunks = [int(c) for c in args.chunks.split(",")]
    arms = [("alone", False)] + ([] if args.no_hog else [("time-sliced", True)])
    pieces = core.runner.pieces
    if args.compare_eager and pieces is not None:  # the same process with its pieces put aside: eager steps
        arms = [(f"{name}, {mode}", hog, on) for name, hog in arms for mode, on in (("pieces", True), ("eager", False))]
    else:
        arms = [(name, hog, True) for name, hog in arms]
    print(f"| GPU | prompt tokens (+{args.decode} decode rows) | launch ms p50 (min-max) | step ms p50 (min-max) |")
    print("|---|---|---|---|")
    for name, hog, use_pieces in arms:
        core.runner.pieces = pieces if use_pieces else None
        stop, ready, proc = None, None, None
        if hog:
            ctx = mp.get_context("spawn")
            stop, ready = ctx.Event(), ctx.Event()
            proc = ctx.Process(target=_hog, args=(stop, ready), daemon=True)
            proc.start()
            ready.wait(120)
            time.sleep(1)
        try:
            for chunk in chunks:
                time_prompt_steps(core, chunk, 2)  # new shapes: cuBLAS heuristics, allocator blocks
                launch, step = time_prompt_steps(core, chunk, args.repeats)
                print(f"| {name} | {chunk} | {statistics.median(launch):.1f} ({min(launch):.1f}-{max(launch):.1f}) "
                      f"| {statistics.median(step):.1f} ({min(step):.1f}-{max(step):.1f}) |", flush=True)  # fmt: skip
        finally:
            if proc is not None:
                stop.set()
                proc.join(30)
    if args.profile and core.model_info.device.type == "cuda":  # the profiler counts device time
        for chunk in chunks:
            profile_prompt_step(core, chunk, args.top)


if __name__ == "__main__":
    main()
