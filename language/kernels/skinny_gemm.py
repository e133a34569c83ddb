"""GEMM for a few rows (decode batches of 2 to 64): a weight stream, for bf16/fp16 operands and, through
fp8_skinny.py, FP8 ones with per-token and per-channel scales. At M <= 64 the GEMM reads N * K weight elements
against M * K activation ones, so its time is the weights' bytes over HBM bandwidth, if enough bytes are in flight.
cuBLAS's 128-wide tiles give N / 128 CTAs (36 for a 4608-wide qkv) on 132 SMs: most SMs idle and the weights stream
below bandwidth (~78 % of copy bandwidth for Qwen2-VL-7B's bf16 linears at M = 64 on an H100).

Here each program owns a narrow BLOCK_N slice of the outputs for all M rows (BLOCK_M: M padded to 16, 32 or 64, so
every weight byte is read once), and, where N / BLOCK_N leaves SMs idle, one of SPLIT_K slices of the reduction
(split-K). Split programs write fp32 partial sums to a [SPLIT_K, M, N] workspace and a second launch adds them in a
fixed order, then scales: not fp32 atomics into a zeroed buffer, which cost a memset launch, a cast launch for
bf16 out anyway, and sum in whatever order the programs finish (results that change from one replay to the next).
The workspace comes from torch's caching allocator, as every output does, so a CUDA graph captures it.

Products accumulate in fp32 and round once to the output dtype, after the bias is added (as cuBLAS's epilogue):
out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); SCALED (FP8) multiplies each output's sum by x_scale[m] * w_scale[n]
first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    HALF_DTYPES,
    cdiv,
    check_linear_operands,
    check_out,
    dot_in_fp32,
    pdl_enter,
    pdl_launch,
    pow2_at_least,
)
from language.kernels.skinny_launches import SkinnyConfig, block_m_for, default_config, launch_for, sm_count

_REDUCE_BLOCK = 512  # outputs per program of the split-K reduction
FP8_PROMOTE_K = 128  # FP8 products the tensor cores sum before each fp32 add (0: none): _partial_product


@triton.jit
def _partial_product(
    x_ptrs, w_ptrs, m_mask, n_mask, offs_k, k_start, k_stop,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr,
):  # fmt: skip
    """sum over k in [k_start, k_stop) of x[m, k] * w[n, k] -> [BLOCK_M, BLOCK_N] fp32 (unscaled).

    FP8 on sm_90 (PROMOTE_K, `max_num_imprecise_acc`): left unset, Triton lets the FP8 tensor cores (wgmma) sum the
    whole reduction in their reduced-precision accumulator (~14 mantissa bits), percents off the reference where a
    sum cancels. At 128 (FP8_PROMOTE_K; a step's columns where fewer), the tensor cores sum 128 products at a time
    and each such partial sum is added to an fp32 accumulator, as DeepGEMM and vLLM's block-FP8 kernels do: each
    partial carries the reduced precision, so an output is within ~2^-13 of the sum of its products' magnitudes
    from the reference. At 0, Triton gives up the FP8 tensor cores: it widens both operands to fp16 (exactly) and
    runs fp16 MMAs (mma.sync) with fp32 sums, the reference's result to fp32 rounding, but the weights then stream
    below bandwidth: on an H100 the 28 layers' linears took 3.29 ms at 64 rows with 128 against 3.64-3.73 ms with
    0, 3.03 against 3.17 ms at 32, level at 8 and 16 (benchmarks/fp8_gemm_bench.py --promote 0,128;
    docs/performance.md). wgmma needs 64 rows on the A side (the padded M, or BLOCK_N when SWAP_AB); narrower
    tiles take the fp16 path either way. bf16/fp16 products accumulate in fp32 either way (Triton ignores the
    argument)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # the swapped product's (dead code otherwise)
    for k0 in range(k_start, k_stop, BLOCK_K):
        if EVEN_K:  # no column mask: the loads stay vectorized
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k0 + offs_k < k_stop
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot (launch_utils.dot_in_fp32); exact: bf16 products fit fp32
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SWAP_AB:
            acc_t = tl.dot(w, tl.trans(x), acc_t, max_num_imprecise_acc=PROMOTE_K)
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_K)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K] bf16/fp16, or e4m3 (SCALED), rows contiguous
    xs_ptr,  # [M, 1] fp32 (unused without SCALED)
    w_ptr,  # [N, K] x's dtype, rows contiguous
    ws_ptr,  # [N, 1] fp32 (unused without SCALED)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1), else the fp32 workspace [SPLIT_K, M, N], contiguous
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_x,
    stride_xs,
    stride_w,
    stride_ws,
    stride_out,
    SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K
    SWAP_AB: tl.constexpr,
    DOT_FP32: tl.constexpr,  # see launch_utils.dot_in_fp32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # At the top: the pipelined loop below loads weights and activations together.
    pdl_enter(USE_PDL)
    # Row tiles vary fastest: programs that read the same weights (M > BLOCK_M) run side by side, and share L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = _partial_product(
        x_ptrs, w_ptrs, m_mask, n_mask, offs_k, k_start, k_stop,
        EVEN_K, SWAP_AB, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_K,
    )  # fmt: skip
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if SCALED:
            xs = tl.load(xs_ptr + offs_m * stride_xs, mask=m_mask, other=0.0)
            ws = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
            acc = acc * (xs[:, None] * ws[None, :])
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_ptrs = out_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32, contiguous
    xs_ptr,  # [M, 1] fp32 (unused without SCALED)
    ws_ptr,  # [N, 1] fp32 (unused without SCALED)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    stride_xs,
    stride_ws,
    stride_out,
    SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # slice 0 first, always: the same sum on every run
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    if SCALED:
        ws = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
        acc = acc * (tl.load(xs_ptr + row * stride_xs) * ws)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]), bf16 or fp16 operands of one dtype -> [M, N] in out_dtype (default
    x's; float32 gives the unrounded sum, as `linear_fp32`). Any M (made for 2 to 64; more rows are more row
    tiles, each streaming the weights again)."""
    check_linear_operands(x, weight, bias, rows=None, dtypes=HALF_DTYPES)
    return launch_skinny(x, None, weight, None, bias, out_dtype or x.dtype, out, config)


def launch_skinny(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
    config: SkinnyConfig | None,
) -> torch.Tensor:
    """The launch behind skinny_gemm and fp8_skinny_gemm, on their checked operands: scaled where the scales are
    given (both or neither); the split-K workspace and its reduction where the config splits (default: the measured
    launch, else `default_config`: skinny_launches.py)."""
    (m, k), num_out, device = x.shape, weight.shape[0], x.device
    if out is None:
        out = torch.empty((m, num_out), dtype=out_dtype, device=device)
    check_out(out, (m, num_out), out_dtype, device)
    assert k >= 1, "weight: empty reduction dimension"
    if m == 0 or num_out == 0:
        return out
    sms, itemsize = sm_count(device), weight.element_size()
    config = config or launch_for(m, num_out, k, itemsize, sms) or default_config(m, num_out, k, sms, itemsize)
    block_m, block_k = block_m_for(m), config.block_k
    assert block_k >= 32 and block_k == pow2_at_least(block_k, 32), f"block_k {block_k}: a power of two >= 32"
    steps = cdiv(k, block_k)
    steps_per_split = cdiv(steps, max(1, config.split_k))
    split_k = cdiv(steps, steps_per_split)  # no empty slice
    target = out if split_k == 1 else torch.empty((split_k, m, num_out), dtype=torch.float32, device=device)
    scaled = x_scale is not None
    xs, ws = (x_scale, weight_scale) if scaled else (weight, weight)  # unread without SCALED
    bias_arg = weight if bias is None else bias
    _skinny_kernel[(cdiv(m, block_m), cdiv(num_out, config.block_n), split_k)](
        x, xs, weight, ws, bias_arg, target, m, num_out, k, steps_per_split * block_k,
        x.stride(0), xs.stride(0), weight.stride(0), ws.stride(0), out.stride(0),
        SCALED=scaled, SPLIT_K=split_k, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        SWAP_AB=config.swap_ab, DOT_FP32=dot_in_fp32(x.dtype), BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        PROMOTE_K=min(FP8_PROMOTE_K, block_k),  # Triton's bound: at most a step's columns
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    if split_k > 1:
        _split_k_reduce_kernel[(m, cdiv(num_out, _REDUCE_BLOCK))](
            target, xs, ws, bias_arg, out, m, num_out, xs.stride(0), ws.stride(0), out.stride(0),
            SCALED=scaled, SPLIT_K=split_k, HAS_BIAS=bias is not None,
            BLOCK=min(_REDUCE_BLOCK, pow2_at_least(num_out, 16)), num_warps=4, **pdl_launch(x.device),
        )  # fmt: skip
    return out
