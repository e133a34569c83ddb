"""Micro-benchmarks of the attention kernels against torch SDPA on equivalent dense tensors (H100, 7B shapes).

Usage: python benchmarks/kernels_bench.py [--sweep]
--sweep also times a few alternative tile configurations (to pick the launchers' defaults)."""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from language.kernels import decode_attention, prefill_attention, rms_norm, silu_and_mul, store_kv

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


def bench_prefill(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, scattered: bool) -> None:
    tokens = batch * seq_len
    q = torch.randn(tokens, num_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache = torch.randn(tokens, num_kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    req_to_token = slot_table(batch, seq_len, scattered)
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_len = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    b_start = b_req_idx * seq_len
    scale = HEAD_DIM**-0.5
    ours = lambda: prefill_attention(
        q, k_cache, v_cache, req_to_token, b_req_idx, b_start, b_len, b_len, scale, max_q_len=seq_len
    )
    # Dense equivalent: [B, H, L, D], K/V gathered by the same slots.
    slots = req_to_token.long()
    qd = q.view(batch, seq_len, num_heads, HEAD_DIM).transpose(1, 2).contiguous()
    kd = k_cache[slots].transpose(1, 2).contiguous()
    vd = v_cache[slots].transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    err = (ours().view(batch, seq_len, num_heads, HEAD_DIM).transpose(1, 2) - sdpa()).abs().max().item()
    flops = 4 * batch * num_heads * seq_len * seq_len / 2 * HEAD_DIM  # causal: half of QK^T and PV
    nbytes = (2 * q.numel() + 2 * tokens * num_kv_heads * HEAD_DIM) * q.element_size()
    layout = "scattered" if scattered else "contiguous"
    name = f"prefill {batch}x{seq_len} Hq={num_heads} Hk={num_kv_heads} D={HEAD_DIM} {layout} slots"
    report(name, ms(ours), ms(sdpa), flops, nbytes, err)


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
    k_cache = torch.empty(8 * tokens, 32, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    k = torch.randn(tokens, 32, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(8 * tokens, device="cuda")[:tokens].int()
    t = ms(lambda: store_kv(k_cache, v_cache, k, k, slots))
    name = "store_kv 4096 tokens x 32 heads x 128, scattered slots"
    print(f"{name:<72} ours {t:8.4f} ms {4 * k.numel() * 2 / t / 1e6:7.0f} GB/s")


def sweep_prefill() -> None:
    default = prefill_module._launch_config
    for block_m, block_n, warps, stages in (
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 8, 4),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 32, 4, 4),
    ):
        config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        prefill_module._launch_config = lambda head_dim, max_q_len, config=config: config
        print(f"-- sweep prefill {config}")
        try:
            bench_prefill(64, 640, 32, 32, scattered=True)
        except Exception as exc:  # e.g. a tile that needs more shared memory than the SM has
            print(f"   failed: {type(exc).__name__}: {str(exc)[:200]}")
    prefill_module._launch_config = default


def sweep_decode() -> None:
    default, default_per_sm = decode_module._launch_config, decode_module._PROGRAMS_PER_SM
    for block_n, warps, stages, per_sm in (
        (32, 4, 3, 4),
        (128, 4, 3, 4),
        (64, 4, 4, 4),
        (64, 4, 2, 8),
        (64, 8, 3, 4),
        (32, 2, 4, 8),
    ):
        config = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        decode_module._launch_config = lambda config=config: config
        decode_module._PROGRAMS_PER_SM = per_sm
        print(f"-- sweep decode {config} programs/SM {per_sm}")
        try:
            for num_heads, num_kv_heads in ((32, 32), (28, 4)):
                for batch in (1, 64):
                    bench_decode(batch, 1024, num_heads, num_kv_heads, graph_only=True)
        except Exception as exc:
            print(f"   failed: {type(exc).__name__}: {str(exc)[:200]}")
    decode_module._launch_config, decode_module._PROGRAMS_PER_SM = default, default_per_sm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {DTYPE}")
    for scattered in (False, True):
        bench_prefill(64, 640, 32, 32, scattered)
    bench_prefill(64, 640, 28, 4, scattered=True)
    for num_heads, num_kv_heads in ((32, 32), (28, 4)):
        for batch in (1, 64):
            bench_decode(batch, 1024, num_heads, num_kv_heads)
    bench_elementwise()
    if not args.sweep:
        return
    sweep_prefill()
    sweep_decode()


if __name__ == "__main__":
    main()
