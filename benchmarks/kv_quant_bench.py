"""The attention kernels and the KV store on a bf16, int8 (--llm_kv_type int8kv) and fp8 (fp8kv) KV cache, Qwen2-VL-7B
heads (28 query, 4 KV, dim 128), on one GPU: ms per call and the quantized kernels' distance from their torch
references (the same quantized arithmetic) and from the bf16 cache's result.

Usage (GPU host, repo root): python benchmarks/kv_quant_bench.py
Decode reads 8-bit K/V, so at long contexts it should run faster than on bf16; prefill is compute-bound, so it should
stay within a few percent of bf16."""

from __future__ import annotations

import functools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from language.kernels import decode_attention, prefill_attention, store_kv
from language.kernels.reference import decode_attention_ref, encode_kv_ref

DTYPE = torch.bfloat16
HQ, HK, D = 28, 4, 128
KV_TYPES = {"bf16": DTYPE, "int8kv": torch.int8, "fp8kv": torch.float8_e4m3fn}


def caches(num_slots: int, storage: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(k_cache, v_cache, k_scale, v_scale) holding the same random values in `storage`."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(num_slots, HK, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(num_slots, HK, D, device="cuda", dtype=DTYPE, generator=gen)
    if storage == DTYPE:
        return k, v, None, None
    head = torch.ones(HK, device="cuda") if storage == torch.float8_e4m3fn else None
    k_cache, k_scale = encode_kv_ref(k, storage, head)
    v_cache, v_scale = encode_kv_ref(v, storage, head)
    return k_cache, v_cache, (head if head is not None else k_scale), (head if head is not None else v_scale)


def bench_decode(batch: int, seq_len: int) -> None:
    slots = torch.randperm(batch * seq_len, device="cuda").view(batch, seq_len).int()
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    results, times = {}, {}
    for name, storage in KV_TYPES.items():
        k_cache, v_cache, k_scale, v_scale = caches(batch * seq_len, storage)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, slots, idx, lens, D**-0.5)
        run = functools.partial(decode_attention, *args, max_seq_len=seq_len, out=out, k_scale=k_scale, v_scale=v_scale)
        times[name] = do_bench_cudagraph(run, rep=100)
        results[name] = out.clone()
        ref = decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale) if batch * seq_len <= 65536 else None
        err = "" if ref is None else f" max|kernel-ref| {(out.float() - ref.float()).abs().max().item():.1e}"
        print(f"decode B={batch:<4} L={seq_len:<6} {name:<7} {times[name]:8.4f} ms "
              f"({times['bf16'] / times[name]:4.2f}x bf16) max|out-bf16| "
              f"{(out.float() - results['bf16'].float()).abs().max().item():.1e}{err}", flush=True)  # fmt: skip


def bench_prefill(batch: int, seq_len: int) -> None:
    tokens = batch * seq_len
    slots = torch.randperm(tokens, device="cuda").view(batch, seq_len).int()
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=DTYPE)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    times = {}
    for name, storage in KV_TYPES.items():
        k_cache, v_cache, k_scale, v_scale = caches(tokens, storage)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, slots, idx, idx * seq_len, lens, lens, D**-0.5)
        run = functools.partial(prefill_attention, *args, max_q_len=seq_len, out=out, k_scale=k_scale, v_scale=v_scale)
        times[name] = do_bench(run, warmup=25, rep=100, return_mode="median")
        ratio = times["bf16"] / times[name]
        print(f"prefill {batch} x {seq_len:<5} {name:<7} {times[name]:8.4f} ms ({ratio:4.2f}x bf16)", flush=True)


def bench_store(tokens: int) -> None:
    k = torch.randn(tokens, HK, D, device="cuda", dtype=DTYPE)
    slot_ids = torch.randperm(4 * tokens, device="cuda")[:tokens].int()
    for name, storage in KV_TYPES.items():
        k_cache, v_cache, k_scale, v_scale = caches(4 * tokens, storage)
        t = do_bench(functools.partial(store_kv, k_cache, v_cache, k, k, slot_ids, k_scale=k_scale, v_scale=v_scale))
        print(f"store_kv {tokens} tokens {name:<7} {t:8.4f} ms", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for batch, seq_len in ((1, 1024), (64, 1024), (256, 512), (1, 16384), (64, 4096)):
        bench_decode(batch, seq_len)
    for batch, seq_len in ((64, 249), (8, 4096)):
        bench_prefill(batch, seq_len)
    bench_store(4096)


if __name__ == "__main__":
    main()
