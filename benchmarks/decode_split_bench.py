"""Decode attention's split-K variants side by side, graph-replayed as a decode step runs them: the two-launch form
(partial kernel, then merge kernel: the form before the fused merge), the fused merge (the last chunk to finish
merges), and the fused merge with a floor on chunk length or other programs per SM. Batches 1-256 at contexts 300
and 1200 with Qwen2-VL-7B's heads, and batch 64 with other families' head dims; bandwidth against the H100's
3.35 TB/s, and each variant's largest difference from the two-launch form's output.

Usage: PYTHONPATH=. python benchmarks/decode_split_bench.py (or benchmarks/kernels_bench.py --only decode_split)"""

from __future__ import annotations

import importlib

import torch
from triton.testing import do_bench_cudagraph

from language.kernels.launch_utils import multiprocessor_count

decode_module = importlib.import_module("language.kernels.decode_attention")  # the package rebinds the name

HBM_GBPS = 3350  # H100 SXM
TABLE_WIDTH = 8192  # the slot table's width, as a decode graph sees it (max_seq_len unknown on the host)
# (label, most chunks merged by the last chunk (0: always a merge kernel), shortest chunk in keys, programs per SM);
# the first is the reference for max|diff|
_ALWAYS = decode_module._MAX_CHUNKS
VARIANTS = (
    ("two launches", 0, 64, 4),
    ("default", decode_module._FUSED_MERGE_MAX_CHUNKS, 64, 4),
    ("fused", _ALWAYS, 64, 4),
    ("fused, chunks >= 128", _ALWAYS, 128, 4),
    ("fused, chunks >= 256", _ALWAYS, 256, 4),
    ("fused, chunks >= 512", _ALWAYS, 512, 4),
    ("fused, 2 programs/SM", _ALWAYS, 64, 2),
    ("fused, 8 programs/SM", _ALWAYS, 64, 8),
)
# (model, query heads, KV heads, head dim, batches)
SHAPES = (
    ("Qwen2-VL-7B", 28, 4, 128, (1, 16, 64, 256)),
    ("Gemma-3-4B", 8, 4, 256, (64,)),
    ("Qwen2-0.5B", 14, 2, 64, (64,)),
)
CONTEXTS = (300, 1200)


def decode_inputs(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
    """bf16 queries and caches; each sequence's slots a random permutation of the cache (pages scattered)."""
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(batch * seq_len, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    req_to_token = torch.zeros(batch, TABLE_WIDTH, device="cuda", dtype=torch.int32)
    req_to_token[:, :seq_len] = torch.randperm(batch * seq_len, device="cuda").view(batch, seq_len).int()
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_seq_len = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len


def set_variant(fused_max_chunks: int, min_chunk: int, programs_per_sm: int) -> None:
    decode_module._FUSED_MERGE_MAX_CHUNKS = fused_max_chunks
    decode_module._MIN_CHUNK = min_chunk
    decode_module._PROGRAMS_PER_SM = programs_per_sm


def bench_case(model: str, batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    args = decode_inputs(batch, seq_len, num_heads, num_kv_heads, head_dim)
    out = torch.empty_like(args[0])
    run = lambda: decode_module.decode_attention(*args, head_dim**-0.5, out=out)  # noqa: E731
    nbytes = 2 * batch * seq_len * num_kv_heads * head_dim * 2 + 2 * out.numel() * 2  # K and V, q and out
    reference = None
    for label, fused_max_chunks, min_chunk, per_sm in VARIANTS:
        set_variant(fused_max_chunks, min_chunk, per_sm)
        chunks = decode_module.decode_split(batch, num_kv_heads, TABLE_WIDTH, out.device)
        result = run().clone()  # eager first: compiles, and sizes the arrival counters before the capture
        reference = result if reference is None else reference
        t_ms = do_bench_cudagraph(run, rep=100)
        gbps = nbytes / t_ms / 1e6
        diff = (result.float() - reference.float()).abs().max().item()
        print(
            f"| {model} ({num_heads}/{num_kv_heads}, D={head_dim}) | {batch} | {seq_len} | {label} | {chunks}"
            f" | {t_ms * 1e3:7.1f} | {gbps:5.0f} | {gbps / HBM_GBPS:5.1%} | {diff:.1e} |",
            flush=True,
        )


def bench_decode_split() -> None:
    defaults = decode_module._FUSED_MERGE_MAX_CHUNKS, decode_module._MIN_CHUNK, decode_module._PROGRAMS_PER_SM
    sms = multiprocessor_count(torch.device("cuda"))
    print(f"\ndecode attention split-K variants, bf16, graph-replayed, {sms} SMs")
    print("| shape | batch | context | variant | grid chunks | us | GB/s | of 3.35 TB/s | max|diff| |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for model, num_heads, num_kv_heads, head_dim, batches in SHAPES:
            for batch in batches:
                for seq_len in CONTEXTS:
                    bench_case(model, batch, seq_len, num_heads, num_kv_heads, head_dim)
                    torch.cuda.empty_cache()
    finally:
        set_variant(*defaults)


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bench_decode_split()
