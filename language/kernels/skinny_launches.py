"""How the weight-streaming GEMM (skinny_gemm.py) is launched for a shape: the launches measured fastest on an H100
where we have them, a first guess from the shapes' arithmetic elsewhere, and, for bf16/fp16 weights, whether it
beats cuBLAS at all.

The measured table comes from benchmarks/bf16_gemm_bench.py (NVIDIA H100 80GB HBM3, 132 SMs, tree of 926cb60,
2026-11-26 01:47 UTC) and fp8_gemm_bench.py (the same GPU, with FP8_PROMOTE_K 128, 2026-11-27 05:33 UTC;
docs/performance.md): the Qwen2-VL-7B decoder's four linears and its LM head at M = 8, 16, 32 and 64 rows, each M
standing for the rows up to it. FP8: our kernel beat the quantizer + cuBLASLt's row-wise `_scaled_mm` at every shape
and M (2.88-3.29 ms against 4.20-4.36 ms for the 28 layers' linears), so unmeasured FP8 shapes take
`default_config`. bf16: cuBLAS streams the narrow qkv and o projections faster at most M
(0.83-0.97x), and our kernel wins on the wide ones by 2-11 %; an unmeasured bf16 shape keeps cuBLAS, since the first
guess lost to it on half the measured cells."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from language.kernels.launch_utils import cdiv, pow2_at_least

MAX_BLOCK_M = 64  # rows per program: more rows are more programs, each reading the same weights again (from L2)
_STEP_BYTES = 256  # a weight row's bytes per reduction step (128 where K is not a multiple of it)
_H100_SMS = 132  # the SM count assumed where there is no CUDA device (the interpreter)
_M_BUCKETS = (8, 16, 32, 64)  # the measured row counts: a launch measured at M serves every M' <= M above the last
SKINNY_MAX_ROWS = _M_BUCKETS[-1]  # the most rows a measured launch serves: more go to cuBLAS(Lt)


class SkinnyConfig(NamedTuple):
    """A launch: output columns per program, reduction columns per step, reduction slices (1: no split), warps,
    pipeline stages, and whether the tensor-core product is taken as w @ x^T (the weights as the MMA's A operand,
    so BLOCK_N, not the padded M, is its 64-row side)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


def _c(block_n: int, block_k: int, split_k: int, stages: int, swap: bool = False) -> SkinnyConfig:
    return SkinnyConfig(block_n, block_k, split_k, num_warps=4, num_stages=stages, swap_ab=swap)


# (weight bytes per element, N, K) -> the fastest launch at each of _M_BUCKETS; None: cuBLAS was faster there.
_MEASURED: dict[tuple[int, int, int], tuple[SkinnyConfig | None, ...]] = {
    # bf16: qkv, o, gate_up, down, LM head
    (2, 4608, 3584): (None, None, None, None),
    (2, 3584, 3584): (_c(64, 64, 5, 4, True), _c(64, 64, 5, 4, True), None, None),
    (2, 37888, 3584): (_c(64, 128, 1, 4), _c(64, 128, 1, 4), _c(64, 128, 1, 3, True), _c(32, 128, 1, 3)),
    (2, 3584, 18944): (_c(32, 128, 3, 4), _c(32, 128, 3, 4, True), _c(32, 128, 3, 4), _c(32, 64, 3, 5)),
    (2, 152064, 3584): (_c(64, 128, 1, 4, True), _c(64, 128, 1, 4, True), _c(64, 128, 1, 3, True), _c(64, 128, 1, 3)),
    # FP8 (per-channel): qkv, o, gate_up, down
    (1, 4608, 3584): (_c(64, 128, 4, 4, True), _c(64, 128, 4, 4, True), _c(64, 256, 3, 4, True), _c(32, 128, 2, 5)),
    (1, 3584, 3584): (_c(64, 128, 5, 4, True), _c(64, 128, 5, 4, True), _c(64, 256, 3, 4, True), _c(32, 128, 3, 5)),
    (1, 37888, 3584): (_c(64, 256, 1, 4), _c(64, 256, 1, 4), _c(64, 256, 1, 3, True), _c(64, 128, 1, 4, True)),
    (1, 3584, 18944): (_c(32, 256, 3, 4), _c(32, 256, 3, 4, True), _c(64, 128, 5, 4, True), _c(64, 128, 5, 4)),
}


@functools.lru_cache(maxsize=1024)  # asked twice per linear of an eager step: by the dispatch and the launch
def launch_for(m: int, n: int, k: int, itemsize: int, sms: int = _H100_SMS) -> SkinnyConfig | None:
    """The launch for m rows of an [n, k] weight of `itemsize` bytes an element: the measured one where the table
    has the shape (None where cuBLAS measured faster), else default_config for FP8 and None (cuBLAS) for bf16/fp16.
    m above SKINNY_MAX_ROWS: None."""
    bucket = next((i for i, top in enumerate(_M_BUCKETS) if m <= top), None)
    if bucket is None:
        return None
    measured = _MEASURED.get((itemsize, n, k))
    if measured is not None:
        return measured[bucket]
    return default_config(m, n, k, sms, itemsize) if itemsize == 1 else None


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)  # an eager step asks once per linear
def default_config(m: int, n: int, k: int, sms: int = _H100_SMS, itemsize: int = 1) -> SkinnyConfig:
    """64-wide output slices, 256-byte steps of each weight row (128 where K is not a multiple of 256 bytes: 256
    FP8 or 128 bf16 columns), 4 warps, 4 stages, and the reduction split by `split_for`. A first guess from the
    shapes' arithmetic, for shapes the measured table lacks. itemsize: the weights' bytes per element (1: FP8,
    2: bf16/fp16)."""
    block_n = 64
    step_bytes = _STEP_BYTES if (k * itemsize) % _STEP_BYTES == 0 else _STEP_BYTES // 2
    block_k = min(step_bytes // itemsize, pow2_at_least(k, 32))
    return SkinnyConfig(block_n, block_k, split_for(m, n, k, block_n, block_k, sms), num_warps=4, num_stages=4)


def split_for(m: int, n: int, k: int, block_n: int, block_k: int, sms: int = _H100_SMS) -> int:
    """Reduction slices for about two programs per SM, keeping at least 4 steps a slice (a slice's pipeline fills
    and drains once)."""
    tiles = cdiv(m, block_m_for(m)) * cdiv(n, block_n)
    return max(1, min(cdiv(2 * sms, tiles), cdiv(k, block_k) // 4))


def block_m_for(m: int) -> int:
    """M padded to the tensor cores' 16 rows, then to a power of two, up to MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, pow2_at_least(m, 16))
