"""Decode attention's variants side by side, graph-replayed as a decode step runs them: each of a 28-layer model's
layers reads its own KV cache, so the keys come from HBM, not from the L2 cache that one layer's cache fits in when it
is replayed alone (64 sequences of 300 keys are 39 MB of K and V; the L2 holds 50 MB). Variants: the two-launch form
(partial kernel, then merge kernel: the form before the fused merge), the launcher's default with and without its
floor on chunk length where the grid is full (shortest_chunk), the fused merge (the last chunk to finish merges),
the fused merge with a floor on chunk length or other programs per SM, and other launch configurations
(key tile, warps, pipeline stages). Batches 1-256 at contexts 300 and 1200 with Qwen2-VL-7B's heads, and batch 64
with other families' head dims; the time per layer, bandwidth against the H100's 3.35 TB/s, and each variant's
largest difference from the two-launch form's output.

Usage: PYTHONPATH=. python benchmarks/decode_split_bench.py (or benchmarks/kernels_bench.py --only decode_split)"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
from triton.testing import do_bench_cudagraph

from language.kernels.launch_utils import multiprocessor_count

decode_module = importlib.import_module("language.kernels.decode_attention")  # the package rebinds the name

HBM_GBPS = 3350  # H100 SXM
TABLE_WIDTH = 8192  # the slot table's width, as a decode graph sees it (max_seq_len unknown on the host)
LAYERS = 28  # Qwen2-VL-7B's: the caches a step reads, far past the L2's 50 MB
_DEFAULT_LAUNCH = decode_module._launch_config()
_ALWAYS = decode_module._MAX_CHUNKS


class Variant(NamedTuple):
    label: str
    fused_max_chunks: int  # most chunks merged by the last chunk to finish (0: always the merge kernel)
    min_chunk: int  # shortest chunk, in keys
    programs_per_sm: int
    launch: dict[str, int] | None = None  # BLOCK_N, num_warps, num_stages (None: the launcher's)
    min_chunk_wide: int | None = None  # shortest chunk where the pairs fill the GPU (None: min_chunk)


def _launch(block_n: int, warps: int, stages: int) -> dict[str, int]:
    return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)


# The first is the reference for max|diff|. The launch variants keep the default's chunking.
_FUSED, _MIN, _PER_SM, _WIDE = (
    decode_module._FUSED_MERGE_MAX_CHUNKS,
    decode_module._MIN_CHUNK,
    decode_module._PROGRAMS_PER_SM,
    decode_module._MIN_CHUNK_WIDE,
)
VARIANTS = (
    Variant("two launches", 0, 64, 4),
    Variant("default", _FUSED, _MIN, _PER_SM, min_chunk_wide=_WIDE),
    Variant("default, no wide floor", _FUSED, _MIN, _PER_SM),
    Variant("fused", _ALWAYS, 64, 4),
    Variant("fused, chunks >= 256", _ALWAYS, 256, 4),
    Variant("fused, chunks >= 512", _ALWAYS, 512, 4),
    Variant("fused, 2 programs/SM", _ALWAYS, 64, 2),
    Variant("fused, 8 programs/SM", _ALWAYS, 64, 8),
    Variant("keys 64, 2 warps, 3 stages", _FUSED, _MIN, _PER_SM, _launch(64, 2, 3), _WIDE),
    Variant("keys 32, 2 warps, 2 stages", _FUSED, _MIN, _PER_SM, _launch(32, 2, 2), _WIDE),
    Variant("keys 32, 2 warps, 3 stages", _FUSED, _MIN, _PER_SM, _launch(32, 2, 3), _WIDE),
    Variant("keys 32, 1 warp, 4 stages", _FUSED, _MIN, _PER_SM, _launch(32, 1, 4), _WIDE),
    Variant("keys 32, 1 warp, 2 stages", _FUSED, 128, _PER_SM, _launch(32, 1, 2), _WIDE),
)
# (model, query heads, KV heads, head dim, batches)
SHAPES = (
    ("Qwen2-VL-7B", 28, 4, 128, (1, 8, 16, 32, 64, 256)),
    ("Gemma-3-4B", 8, 4, 256, (64,)),
    ("Qwen2-0.5B", 14, 2, 64, (64,)),
)
CONTEXTS = (300, 1200)


def decode_inputs(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
    """bf16 queries (a view into a fused qkv output, as the model passes them) and LAYERS caches; each sequence's
    slots a random permutation of the cache (pages scattered)."""
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :num_heads]
    rows = (batch * seq_len, num_kv_heads, head_dim)
    k_caches = [torch.randn(rows, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_caches = [torch.randn(rows, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    req_to_token = torch.zeros(batch, TABLE_WIDTH, device="cuda", dtype=torch.int32)
    req_to_token[:, :seq_len] = torch.randperm(batch * seq_len, device="cuda").view(batch, seq_len).int()
    b_req_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    b_seq_len = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    return q, k_caches, v_caches, req_to_token, b_req_idx, b_seq_len


def set_variant(v: Variant) -> None:
    decode_module._FUSED_MERGE_MAX_CHUNKS = v.fused_max_chunks
    decode_module._MIN_CHUNK = v.min_chunk
    decode_module._MIN_CHUNK_WIDE = v.min_chunk_wide or v.min_chunk
    decode_module._PROGRAMS_PER_SM = v.programs_per_sm
    launch = v.launch or _DEFAULT_LAUNCH
    decode_module._launch_config = lambda: launch


def bench_case(model: str, batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    q, k_caches, v_caches, req_to_token, b_req_idx, b_seq_len = decode_inputs(
        batch, seq_len, num_heads, num_kv_heads, head_dim
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def run() -> torch.Tensor:  # a step's layers, each on its own cache
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            decode_module.decode_attention(
                q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, head_dim**-0.5, out=out
            )
        return out

    nbytes = 2 * batch * seq_len * num_kv_heads * head_dim * 2 + 2 * out.numel() * 2  # K and V, q and out
    # do_bench_cudagraph runs on a stream of its own, which does not wait for this one: the inputs must be written
    # before it reads them (else it may read slot ids that are not there yet, and fault).
    torch.cuda.synchronize()
    reference = None
    for v in VARIANTS:
        set_variant(v)
        chunks = decode_module.decode_split(batch, num_kv_heads, TABLE_WIDTH, out.device)
        result = run().clone()  # eager first: compiles, and sizes the arrival counters before the capture
        torch.cuda.synchronize()
        reference = result if reference is None else reference
        t_ms = do_bench_cudagraph(run, rep=100) / LAYERS
        gbps = nbytes / t_ms / 1e6
        diff = (result.float() - reference.float()).abs().max().item()
        print(
            f"| {model} ({num_heads}/{num_kv_heads}, D={head_dim}) | {batch} | {seq_len} | {v.label} | {chunks}"
            f" | {t_ms * 1e3:7.1f} | {gbps:5.0f} | {gbps / HBM_GBPS:5.1%} | {diff:.1e} |",
            flush=True,
        )


def bench_decode_split() -> None:
    launch_config = decode_module._launch_config
    sms = multiprocessor_count(torch.device("cuda"))
    print(f"\ndecode attention variants, bf16, {LAYERS} layers' caches graph-replayed, {sms} SMs; us a layer")
    print("| shape | batch | context | variant | grid chunks | us | GB/s | of 3.35 TB/s | max|diff| |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for model, num_heads, num_kv_heads, head_dim, batches in SHAPES:
            for batch in batches:
                for seq_len in CONTEXTS:
                    bench_case(model, batch, seq_len, num_heads, num_kv_heads, head_dim)
                    torch.cuda.empty_cache()
    finally:
        set_variant(VARIANTS[1])
        decode_module._launch_config = launch_config


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bench_decode_split()
