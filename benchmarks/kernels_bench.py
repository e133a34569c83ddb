"""Micro-benchmarks of the attention kernels against torch SDPA on equivalent dense tensors (H100, 7B shapes), and
of the batch-1 GEMV against cuBLAS.

Usage: python benchmarks/kernels_bench.py [--sweep] [--only prefill|decode|decode_split|elementwise|gemv]
       [--baseline DIR]
The prefill table (bf16, the serving loads' prompt shapes, Qwen2-VL-7B and LLaVA-7B heads) compares with SDPA's
flash backend; --baseline DIR adds a column for an older prefill kernel kept in DIR (old_prefill_attention.py).
--sweep also times alternative tile configurations (to fill the launchers' tables). decode_split times decode
attention's split-K variants (decode_split_bench.py)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from benchmarks.decode_split_bench import bench_decode_split
from language.kernels import (
    decode_attention,
    gelu_tanh_and_mul,
    gemma_norm_add_norm,
    gemv,
    rms_norm,
    silu_and_mul,
    store_kv,
)

# The package rebinds these names to the dispatching functions, so fetch the modules themselves.
decode_module = importlib.import_module("language.kernels.decode_attention")
prefill_module = importlib.import_module("language.kernels.prefill_attention")

DTYPE = torch.float16
HEAD_DIM = 128


def host_us(fn, calls: int = 200) -> float:
    """CPU time per call when calls are queued back to back: the launch overhead an eager (un-graphed) step pays."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def ms(fn, graph: bool = False) -> float:
    return do_bench_cudagraph(fn, rep=100) if graph else do_bench(fn, warmup=25, rep=100, return_mode="median")


def slot_table(batch: int, seq_len: int, scattered: bool) -> torch.Tensor:
    """[batch, seq_len] int32: each sequence's token slots, one contiguous run each or a random permutation."""
    slots = (
        torch.randperm(batch * seq_len, device="cuda") if scattered else torch.arange(batch * seq_len, device="cuda")
    )
    return slots.view(batch, seq_len).int()


PREFILL_SHAPES = ((64, 249), (64, 1129), (8, 4096), (1, 1129))  # (sequences, tokens each): the serving loads' prompts
PREFILL_HEADS = (("Qwen2-VL-7B", 28, 4), ("LLaVA-7B", 32, 32))  # (model, query heads, KV heads), head dim 128
PREFILL_DTYPE = torch.bfloat16
# Candidate tiles for --sweep: (BLOCK_M, BLOCK_N, num_warps, num_stages); each also with and without GQA packing.
PREFILL_SWEEP = ((128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 2), (128, 32, 4, 3), (128, 32, 4, 4), (128, 128, 8, 3))


def prefill_case(
    batch: int, seq_len: int, num_heads: int, num_kv_heads: int
) -> tuple[Callable, Callable, Callable, Callable]:
    """(ours(module), sdpa(), sdpa_default(), max|diff|(module)) for `batch` sequences of `seq_len` new tokens, no
    prefix, K/V in scattered slots; SDPA runs on the same values as dense [B, H, L, D] tensors, once held to its
    flash backend (FlashAttention-2) and once with the backend torch picks by itself (on Hopper that can be cuDNN)."""
    tokens = batch * seq_len
    q = torch.randn(tokens, num_heads, HEAD_DIM, device="cuda", dtype=PREFILL_DTYPE)
    k_cache = torch.randn(tokens, num_kv_heads, HEAD_DIM, device="cuda", dtype=PREFILL_DTYPE)
    v_cache = torch.randn_like(k_cache)
    req_to_token = slot_table(batch, seq_len, scattered=True)
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_len = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    b_start = b_req_idx * seq_len
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, req_to_token, b_req_idx, b_start, b_len, b_len, scale)

    def ours(module) -> Callable:
        return lambda: module.prefill_attention(*args, max_q_len=seq_len, out=out)

    slots = req_to_token.long()
    qd = q.view(batch, seq_len, num_heads, HEAD_DIM).transpose(1, 2).contiguous()
    kd = k_cache[slots].transpose(1, 2).contiguous()  # [B, Hk, L, D]
    vd = v_cache[slots].transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # fail rather than fall back to a slower backend
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)

    def sdpa_default() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)

    expected = sdpa()

    def max_diff(module) -> float:
        got = ours(module)().view(batch, seq_len, num_heads, HEAD_DIM).transpose(1, 2)
        return (got.float() - expected.float()).abs().max().item()

    return ours, sdpa, sdpa_default, max_diff


def prefill_flops(batch: int, seq_len: int, num_heads: int) -> float:
    return 4 * batch * num_heads * HEAD_DIM * seq_len * (seq_len + 1) / 2  # causal: QK^T and PV over the triangle


def bench_prefill_table(baseline=None) -> None:
    """Markdown table: our kernel (and optionally an older one) against SDPA flash, bf16, scattered slots."""
    print(f"\nprefill attention, {PREFILL_DTYPE}, D={HEAD_DIM}, causal, K/V through scattered slots; SDPA flash dense")
    before = " ms before |" if baseline else ""
    print(f"| model (Hq/Hk) | batch x tokens | ms ours |{before} ms SDPA flash | ours/SDPA flash | TFLOP/s ours |"
          " TFLOP/s SDPA flash | ms SDPA default | max abs diff |")  # fmt: skip
    print("|---|---|---|" + ("---|" if baseline else "") + "---|---|---|---|---|---|")
    for model, num_heads, num_kv_heads in PREFILL_HEADS:
        for batch, seq_len in PREFILL_SHAPES:
            ours, sdpa, sdpa_default, max_diff = prefill_case(batch, seq_len, num_heads, num_kv_heads)
            t_ours, t_sdpa = ms(ours(prefill_module)), ms(sdpa)
            t_before = f" {ms(ours(baseline)):.3f} |" if baseline else ""
            flops = prefill_flops(batch, seq_len, num_heads)
            print(
                f"| {model} ({num_heads}/{num_kv_heads}) | {batch} x {seq_len} | {t_ours:.3f} |{t_before} {t_sdpa:.3f}"
                f" | {t_ours / t_sdpa:.2f} | {flops / t_ours / 1e9:.0f} | {flops / t_sdpa / 1e9:.0f}"
                f" | {ms(sdpa_default):.3f} | {max_diff(prefill_module):.1e} |",
                flush=True,
            )
            torch.cuda.empty_cache()


def bench_decode(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, graph_only: bool = False) -> None:
    q = torch.randn(batch, num_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache = torch.randn(batch * seq_len, num_kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    req_to_token = slot_table(batch, seq_len, scattered=True)
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_seq_len = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    ours = lambda: decode_attention(
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, scale, max_seq_len=seq_len, out=out
    )
    slots = req_to_token.long()
    qd = q[:, :, None, :]
    kd = k_cache[slots].transpose(1, 2).contiguous()
    vd = v_cache[slots].transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
    err = (ours() - sdpa()[:, :, 0]).abs().max().item()
    nbytes = 2 * batch * seq_len * num_kv_heads * HEAD_DIM * q.element_size() + 2 * q.numel() * q.element_size()
    flops = 4 * batch * num_heads * seq_len * HEAD_DIM
    name = f"decode B={batch} L={seq_len} Hq={num_heads} Hk={num_kv_heads} D={HEAD_DIM}"
    report(name + " graph", ms(ours, graph=True), ms(sdpa, graph=True), flops, nbytes, err)
    if graph_only:
        return
    report(name + " eager", ms(ours), ms(sdpa), flops, nbytes, err)
    print(f"{'':<72} host launch overhead: ours {host_us(ours):6.1f} us/call, sdpa {host_us(sdpa):6.1f} us/call")


def bench_decode_mixed(batch: int, lo: int, hi: int, num_heads: int = 28, num_kv_heads: int = 4) -> None:
    """A serving batch's decode attention: sequence lengths drawn uniformly from [lo, hi] (seeded), slots of each
    sequence one contiguous run (a prompt prefilled at once). Graph-replayed, as a decode step runs it."""
    gen = torch.Generator().manual_seed(batch * 7 + hi)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    q = torch.randn(batch, num_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache = torch.randn(batch * hi, num_kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    req_to_token = slot_table(batch, hi, scattered=False)
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_seq_len = lens.to(device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    ours = lambda: decode_attention(
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, HEAD_DIM**-0.5, max_seq_len=hi, out=out
    )
    t = ms(ours, graph=True)
    nbytes = 2 * int(lens.sum()) * num_kv_heads * HEAD_DIM * q.element_size()
    name = f"decode mixed B={batch} L={lo}-{hi} Hq={num_heads} Hk={num_kv_heads}"
    print(f"{name:<72} ours {t:8.4f} ms {nbytes / t / 1e6:7.0f} GB/s", flush=True)


def report(name: str, ours_ms: float, sdpa_ms: float, flops: float, nbytes: float, err: float) -> None:
    print(
        f"{name:<72} ours {ours_ms:8.4f} ms {nbytes / ours_ms / 1e6:7.0f} GB/s {flops / ours_ms / 1e9:6.1f} TFLOP/s"
        f" | sdpa {sdpa_ms:8.4f} ms {nbytes / sdpa_ms / 1e6:7.0f} GB/s {flops / sdpa_ms / 1e9:6.1f} TFLOP/s"
        f" | ours/sdpa {ours_ms / sdpa_ms:5.2f} | max|diff| {err:.1e}",
        flush=True,
    )


def bench_elementwise() -> None:
    """7B-shaped norm, MLP activation and KV store at 4096 tokens: bandwidth only."""
    tokens, hidden, inter = 4096, 4096, 11008
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    t = ms(lambda: rms_norm(x, w, 1e-6))
    print(f"{'rms_norm 4096x4096':<72} ours {t:8.4f} ms {2 * x.numel() * 2 / t / 1e6:7.0f} GB/s")
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
    t = ms(lambda: silu_and_mul(gate_up))
    name = "silu_and_mul 4096x(2x11008)"
    print(f"{name:<72} ours {t:8.4f} ms {1.5 * gate_up.numel() * 2 / t / 1e6:7.0f} GB/s")
    t = ms(lambda: gelu_tanh_and_mul(gate_up))
    name = "gelu_tanh_and_mul 4096x(2x11008) (Gemma 3)"
    print(f"{name:<72} ours {t:8.4f} ms {1.5 * gate_up.numel() * 2 / t / 1e6:7.0f} GB/s")
    t = ms(lambda: gemma_norm_add_norm(x, x, w, w, 1e-6))  # reads x and residual, writes normed and sum
    print(f"{'gemma_norm_add_norm 4096x4096 (Gemma 3)':<72} ours {t:8.4f} ms {4 * x.numel() * 2 / t / 1e6:7.0f} GB/s")
    k_cache = torch.empty(8 * tokens, 32, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    k = torch.randn(tokens, 32, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(8 * tokens, device="cuda")[:tokens].int()
    t = ms(lambda: store_kv(k_cache, v_cache, k, k, slots))
    name = "store_kv 4096 tokens x 32 heads x 128, scattered slots"
    print(f"{name:<72} ours {t:8.4f} ms {4 * k.numel() * 2 / t / 1e6:7.0f} GB/s")


# A Qwen2-VL-7B decode step's linear layers at batch 1: (name, out features, in features, bias, layers)
GEMV_SHAPES = [
    ("qkv_proj", 4608, 3584, True, 28),
    ("o_proj", 3584, 3584, False, 28),
    ("gate_up_proj", 37888, 3584, False, 28),
    ("down_proj", 3584, 18944, False, 28),
    ("lm_head", 152064, 3584, False, 2),
]


def bench_gemv() -> None:
    """One row times each layer's weight, bf16: one weight per layer (so none is served from L2), every layer's call
    replayed back to back in one CUDA graph, as in a decode step; per call, ours against F.linear (cuBLAS)."""
    dtype = torch.bfloat16
    for name, num_out, k, with_bias, layers in GEMV_SHAPES:
        weights = [torch.randn(num_out, k, device="cuda", dtype=dtype) * 0.02 for _ in range(layers)]
        bias = torch.randn(num_out, device="cuda", dtype=dtype) if with_bias else None
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        ours_ms, cublas_ms = (
            ms(lambda f=f, weights=weights, bias=bias, x=x: [f(x, w, bias) for w in weights], graph=True) / layers
            for f in (gemv, F.linear)
        )
        ref = F.linear(x.float(), weights[0].float(), None if bias is None else bias.float())
        err = (gemv(x, weights[0], bias).float() - ref).abs().max().item()
        nbytes = num_out * k * 2
        print(
            f"{f'gemv {name} [1, {k}] x [{num_out}, {k}]':<72} ours {ours_ms * 1e3:7.2f} us "
            f"{nbytes / ours_ms / 1e9:5.2f} TB/s | cuBLAS {cublas_ms * 1e3:7.2f} us "
            f"{nbytes / cublas_ms / 1e9:5.2f} TB/s"
            f" | ours/cuBLAS {ours_ms / cublas_ms:5.2f} | max|diff| vs fp32 {err:.1e}",
            flush=True,
        )


def sweep_prefill() -> None:
    """Every PREFILL_SWEEP tile on every table shape, GQA packing on and off: one markdown table per shape."""
    default = prefill_module._launch_config
    for model, num_heads, num_kv_heads in PREFILL_HEADS:
        packs = (1, 0) if num_heads > num_kv_heads else (0,)
        for batch, seq_len in PREFILL_SHAPES:
            ours, sdpa, _, max_diff = prefill_case(batch, seq_len, num_heads, num_kv_heads)
            flops = prefill_flops(batch, seq_len, num_heads)
            print(
                f"\n-- sweep prefill {model} ({num_heads}/{num_kv_heads}) {batch} x {seq_len}: SDPA {ms(sdpa):.3f} ms"
            )
            print("| BLOCK_M | BLOCK_N | warps | stages | GQA pack | ms | TFLOP/s | max abs diff |")
            print("|---|---|---|---|---|---|---|---|")
            for (block_m, block_n, warps, stages), pack in ((c, p) for c in PREFILL_SWEEP for p in packs):
                config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, PACK_GQA=pack)
                prefill_module._launch_config = lambda head_dim, max_q_len, config=config: dict(config)
                row = f"| {block_m} | {block_n} | {warps} | {stages} | {pack} |"
                try:
                    t = ms(ours(prefill_module))
                    print(f"{row} {t:.3f} | {flops / t / 1e9:.0f} | {max_diff(prefill_module):.1e} |", flush=True)
                except Exception as exc:  # e.g. a tile that needs more shared memory than the SM has
                    print(f"{row} failed: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
            prefill_module._launch_config = default
            torch.cuda.empty_cache()


# Serving batches of mixed lengths (text_mixed_x256's prompts of ~100-1800 tokens): (batch, shortest, longest)
MIXED_DECODE = ((64, 300, 300), (64, 100, 1800), (160, 100, 1800), (256, 100, 1800), (256, 300, 300))


def sweep_decode() -> None:
    default, default_per_sm = decode_module._launch_config, decode_module._PROGRAMS_PER_SM
    for block_n, warps, stages, per_sm in (
        (32, 4, 3, 4),
        (128, 4, 3, 4),
        (64, 4, 4, 4),
        (64, 4, 2, 8),
        (64, 8, 3, 4),
        (32, 2, 4, 8),
        (64, 4, 2, 4),
        (32, 4, 2, 8),
        (128, 8, 2, 4),
    ):
        config = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        decode_module._launch_config = lambda config=config: config
        decode_module._PROGRAMS_PER_SM = per_sm
        print(f"-- sweep decode {config} programs/SM {per_sm}")
        try:
            for num_heads, num_kv_heads in ((32, 32), (28, 4)):
                for batch in (1, 64):
                    bench_decode(batch, 1024, num_heads, num_kv_heads, graph_only=True)
            for batch, lo, hi in MIXED_DECODE:
                bench_decode_mixed(batch, lo, hi)
        except Exception as exc:
            print(f"   failed: {type(exc).__name__}: {str(exc)[:200]}")
    decode_module._launch_config, decode_module._PROGRAMS_PER_SM = default, default_per_sm


def load_baseline(directory: str | None):
    """The older prefill kernel kept (outside git) in `directory` as old_prefill_attention.py, or None."""
    if directory is None:
        return None
    sys.path.insert(0, directory)
    return importlib.import_module("old_prefill_attention")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", choices=("prefill", "decode", "decode_split", "elementwise", "gemv"))
    parser.add_argument("--baseline", help="folder holding an older old_prefill_attention.py to time beside ours")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.only in (None, "prefill"):
        bench_prefill_table(load_baseline(args.baseline))
        if args.sweep:
            sweep_prefill()
    if args.only in (None, "decode"):
        print(f"\ndecode attention, {DTYPE}")
        for num_heads, num_kv_heads in ((32, 32), (28, 4)):
            for batch in (1, 64):
                bench_decode(batch, 1024, num_heads, num_kv_heads)
        for seq_len in (4096, 16384):  # one long request: the split-K path
            bench_decode(1, seq_len, 28, 4, graph_only=True)
        for batch, lo, hi in MIXED_DECODE:
            bench_decode_mixed(batch, lo, hi)
        if args.sweep:
            sweep_decode()
    if args.only in (None, "decode_split"):
        bench_decode_split()
    if args.only in (None, "elementwise"):
        bench_elementwise()
    if args.only in (None, "gemv"):
        bench_gemv()


if __name__ == "__main__":
    main()
