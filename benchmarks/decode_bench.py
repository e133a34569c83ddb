"""Decode step time of the engine on a 7B-shaped random Llama, beside the memory-bandwidth roofline.

    python benchmarks/decode_bench.py --model_dir /tmp/llama7b   # builds the checkpoint there if missing
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 1 --profile 1 --top 40  # any family's LM
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 1,64 --quant_type fp8w8a8  # FP8 linears
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 64 --llm_kv_type fp8kv  # 8-bit KV
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 1,64 --pdl on,off  # PDL against none
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 64 --penalties  # Qwen's recommended penalties
    python benchmarks/decode_bench.py --model_dir /tmp/q2vl7b --batches 64 --top_p  # OpenAI-style top-p sampling

Measures the engine's own step() (CUDA-graph decode + sampling + bookkeeping) in steady state: all requests
prefilled, every step a pure decode of the whole batch."""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from benchmarks.loads import SAMPLING as REQUEST_SAMPLING
from language.config import EngineConfig
from language.engine import EngineCore
from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.testing.checkpoints.llama import build_llama

COPY_BANDWIDTH = 3.0e12  # bytes/s, H100 device-to-device copy (measured; docs/performance.md, Anchors)


# Qwen's recommended sampling (Qwen3-VL's model card: presence penalty 1.5, top-k 20, top-p 0.8, temperature 0.7; the
# repetition penalty of Qwen2-VL's generation config): every request goes through the penalties
PENALTIES = dict(repetition_penalty=1.05, presence_penalty=1.5, do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
# An OpenAI client's usual sampling, serve_bench's --sampling top_p: temperature and top-p, no top-k (the nucleus
# draw over the whole vocabulary)
TOP_P = dict(do_sample=True, **REQUEST_SAMPLING["top_p"])
SAMPLING = {"greedy": {}, "penalties": PENALTIES, "top_p": TOP_P}


def decode_ms_per_step(core: EngineCore, batch: int, prompt_len: int, steps: int, sampling: str = "greedy") -> float:
    params = SamplingParams(max_new_tokens=steps + 20, ignore_eos=True, **SAMPLING[sampling])
    reqs = [Request(f"b{batch}-{i}", [1 + (i + j) % 1000 for j in range(prompt_len)], params) for i in range(batch)]
    for r in reqs:
        core.add_request(r)
    while core.stats().waiting:  # prefill everything first
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - t0) / steps
    for r in reqs:
        core.abort(r.rid)
    core.step()
    return elapsed * 1e3


def profile_steps(core: EngineCore, batch: int, prompt_len: int, steps: int, top: int = 15) -> None:
    """Where one decode step's time goes: GPU kernel time per step against the step's wall time (the difference
    is the GPU idle between kernels and steps), and the kernels that take the most."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=steps + 40, ignore_eos=True)
    reqs = [Request(f"p{batch}-{i}", [1 + (i + j) % 1000 for j in range(prompt_len)], params) for i in range(batch)]
    for r in reqs:
        core.add_request(r)
    while core.stats().waiting:
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / steps * 1e6
    for r in reqs:
        core.abort(r.rid)
    core.step()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    gpu_us = sum(e.device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    print(
        f"batch {batch}: {wall_us:.0f} us per step, GPU busy {gpu_us:.0f} us ({launches:.0f} kernels), "
        f"idle {wall_us - gpu_us:.0f} us"
    )
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / steps:8.1f} us  x{e.count / steps:5.1f}  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default="/tmp/llama7b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", default="", help="batch sizes to profile after the table, e.g. 1,64")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profiled batch size")
    ap.add_argument("--quant_type", default="none", help="the engine's --quant_type (fp8w8a8: FP8 linears)")
    ap.add_argument("--llm_kv_type", default="None", help="the engine's --llm_kv_type (int8kv, fp8kv: 8-bit KV)")
    ap.add_argument("--penalties", action="store_true", help="every request samples with Qwen's recommended penalties")
    ap.add_argument("--top_p", action="store_true", help="every request samples at temperature 0.7, top-p 0.9")
    ap.add_argument(
        "--disable_fp8_fused_quant", action="store_true", help="the engine's: each FP8 linear quantizes its own input"
    )
    ap.add_argument(
        "--pdl", default="on", help="programmatic dependent launch: on, off, or on,off (one engine after the other)"
    )
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        t0 = time.perf_counter()
        build_llama(args.model_dir, "7b", torch.float16, num_shards=None, device="cuda")
        print(f"built 7B-shaped random Llama in {time.perf_counter() - t0:.0f} s")
    settings = [s.strip() for s in args.pdl.split(",")]
    assert settings and set(settings) <= {"on", "off"}, f"--pdl {args.pdl}: on, off or both"
    rows = []
    for pdl in settings:
        rows += bench_engine(args, pdl == "on")
    setting = f"{args.quant_type}, {args.llm_kv_type}, {sampling(args)}"
    print(f"| batch | PDL | ms per step | tokens/s | x roofline |  ({setting})")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row)


def sampling(args: argparse.Namespace) -> str:
    assert not (args.penalties and args.top_p), "--penalties or --top_p, not both"
    return "penalties" if args.penalties else "top_p" if args.top_p else "greedy"


def bench_engine(args: argparse.Namespace, pdl: bool) -> list[str]:
    """One engine with PDL on or off: its table rows (and profiles, printed), then the engine freed."""
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(model_dir=args.model_dir, max_total_token_num=80_000, running_max_req_size=128,
                                   quant_type=args.quant_type, llm_kv_type=args.llm_kv_type, pdl=pdl,
                                   fp8_fused_quant=not args.disable_fp8_fused_quant))  # fmt: skip
    print(f"engine (PDL {'on' if pdl else 'off'}) up in {time.perf_counter() - t0:.0f} s")
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    floor = weight_bytes / COPY_BANDWIDTH * 1e3
    print(f"weights {weight_bytes / 1e9:.2f} GB -> roofline {floor:.2f} ms per step (weights / 3.0 TB/s)")
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ms = decode_ms_per_step(core, b, args.prompt_len, args.steps, sampling(args))
        rows.append(f"| {b} | {'on' if pdl else 'off'} | {ms:.2f} | {b * 1e3 / ms:.0f} | {ms / floor:.2f} |")
        print(rows[-1])
    for b in (int(x) for x in args.profile.split(",") if x):
        profile_steps(core, b, args.prompt_len, 20, args.top)
    core.close()
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
