"""Plain-torch references for the layers' kernels (the sampling kernels' are in sampling_reference.py): the
definition of what each Triton kernel computes, and the path the engine takes when there is no GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from language.kernels.fp8_quant import FP8_DTYPE, MIN_SCALE, MeasuredRows, QuantizedRows
from language.kernels.kv_quant import FP8_MAX, INT8_MAX


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, H], weight: [H] -> [N, H]. Same rounding as HF Llama: normalise in fp32, cast, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] in x's dtype. HF's Gemma3RMSNorm: normalise and scale by (1 + weight), all
    in fp32, then round."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gemma_norm_add_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, x_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (gemma_rms_norm_ref(summed, weight), summed), summed = residual + gemma_rms_norm_ref(x, x_weight): HF Gemma's
    post-norm of a sublayer's output, its residual add, then the next sublayer's pre-norm."""
    summed = residual + gemma_rms_norm_ref(x, x_weight, eps)
    return gemma_rms_norm_ref(summed, weight, eps), summed


def qk_rms_norm_ref(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float, gemma: bool = False
) -> torch.Tensor:
    """qk: [N, Hq + Hk, D] -> [N, Hq + Hk, D]: RMSNorm over each head, the query heads scaled by q_weight [D], the key
    heads by k_weight [D] (Qwen3's q_norm / k_norm; `gemma`: Gemma's norm, by (1 + weight) before rounding)."""
    norm = gemma_rms_norm_ref if gemma else rms_norm_ref
    q = norm(qk[:, :num_q_heads], q_weight, eps)
    k = norm(qk[:, num_q_heads:], k_weight, eps)
    return torch.cat([q, k], dim=1)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm_ref(residual + x), residual + x): HF's residual add, then the next sublayer's pre-norm."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def quantize_rows_ref(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8's reference: x [M, K] -> (q [M, K] e4m3, scales [M, ceil(K / group)] fp32), per row (group
    None) or per row and `group` columns."""
    m, k = x.shape
    group = group or k
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scales = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, G]
    q = (padded * (1.0 / scales)[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scales


def quantized_rows_ref(x: torch.Tensor) -> QuantizedRows:
    """x [M, K] quantized per row, as the FP8 linears' producers write it."""
    q, scale = quantize_rows_ref(x)
    return QuantizedRows(q, scale, x.dtype)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
    return quantized_rows_ref(rms_norm_ref(x, weight, eps))


def add_rms_norm_fp8_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[QuantizedRows, torch.Tensor]:
    normed, summed = add_rms_norm_ref(x, residual, weight, eps)
    return quantized_rows_ref(normed), summed


def silu_and_mul_fp8_ref(x: torch.Tensor) -> QuantizedRows:
    return quantized_rows_ref(silu_and_mul_ref(x))


def gelu_tanh_and_mul_fp8_ref(x: torch.Tensor) -> QuantizedRows:
    return quantized_rows_ref(gelu_tanh_and_mul_ref(x))


def measured_rows_ref(x: torch.Tensor) -> MeasuredRows:
    """x [M, K] with each row's largest magnitude [M, 1], as the FP8 GEMV's producers write it."""
    return MeasuredRows(x, x.abs().amax(dim=1, keepdim=True).float())


def rms_norm_measured_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> MeasuredRows:
    return measured_rows_ref(rms_norm_ref(x, weight, eps))


def add_rms_norm_measured_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[MeasuredRows, torch.Tensor]:
    normed, summed = add_rms_norm_ref(x, residual, weight, eps)
    return measured_rows_ref(normed), summed


def silu_and_mul_measured_ref(x: torch.Tensor) -> MeasuredRows:
    return measured_rows_ref(silu_and_mul_ref(x))


def gelu_tanh_and_mul_measured_ref(x: torch.Tensor) -> MeasuredRows:
    return measured_rows_ref(gelu_tanh_and_mul_ref(x))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> silu(gate) * up: [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] = [gate | up] -> gelu(gate, approximate="tanh") * up: [N, I] (Gemma's MLP, HF's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] -> cos, sin: [N, D/2] in fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos(), freqs.sin()


def mrope_cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [3, N] (temporal, height, width) -> cos, sin: [N, D/2]. Frequency band i of the half head dim takes
    its angle from axis j for the j-th chunk of `mrope_section` (Qwen2-VL's M-RoPE); interleaved (Qwen3-VL), bands
    cycle t, h, w: band f follows height if f % 3 == 1 and f < 3 * section[1], width if f % 3 == 2 and
    f < 3 * section[2], else the temporal axis."""
    freqs = positions.float()[:, :, None] * inv_freq.float()[None, None, :]  # [3, N, D/2]
    device = positions.device
    if interleaved:
        band = torch.arange(inv_freq.shape[0], device=device)
        axis = torch.zeros_like(band)
        axis[(band % 3 == 1) & (band < 3 * mrope_section[1])] = 1
        axis[(band % 3 == 2) & (band < 3 * mrope_section[2])] = 2
    else:
        axis = torch.repeat_interleave(
            torch.arange(len(mrope_section), device=device), torch.tensor(mrope_section, device=device)
        )  # [D/2]: which axis each band follows
    freqs = freqs.gather(0, axis[None, None, :].expand(1, freqs.shape[1], -1)).squeeze(0)  # [N, D/2]
    return freqs.cos(), freqs.sin()


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D], cos/sin: [N, D/2] -> rotated x (neox / rotate-half style), same dtype as x.
    Computed as HF does: x * cos + rotate_half(x) * sin with cos/sin cast to x's dtype first."""
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def encode_kv_ref(
    x: torch.Tensor, cache_dtype: torch.dtype, head_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, Hk, D] -> (x as the cache stores it, in cache_dtype; int8's new scales [N, Hk] fp32, else None).
    int8: per row, scale = absmax / 127 and round(x * 127 / absmax), half away from zero. float8 e4m3:
    x / head_scale [Hk], clamped to +-448. A float cache: x cast."""
    if cache_dtype == torch.int8:
        xf = x.float()
        absmax = xf.abs().amax(-1)  # [N, Hk]
        # tensor / tensor: with a Python number on either side, CUDA divides by a reciprocal, then multiplies (two
        # roundings), where the store kernel divides once
        scaled = xf * torch.where(absmax > 0, absmax.new_tensor(INT8_MAX) / absmax, 0.0)[..., None]
        rounded = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
        return rounded.to(torch.int8), absmax / absmax.new_tensor(INT8_MAX)  # a true division on a GPU too
    if cache_dtype == torch.float8_e4m3fn:
        inv = head_scale.new_tensor(1.0) / head_scale  # [Hk]
        return (x.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype), None
    return x.to(cache_dtype), None


def decode_kv_ref(rows: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """rows = cache[slots] [L, Hk, D] -> their values in fp32: stored * scale, the scale per (slot, head) [S, Hk]
    (int8) or per head [Hk] (float8); a float cache's rows as they are."""
    values = rows.float()
    if scale is None:
        return values
    if scale.dim() == 2:
        return values * scale[slots][..., None]
    return values * scale[None, :, None]


def store_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache/v_cache: [S, Hk, D]; k/v: [N, Hk, D]; slots: [N] -> k_cache[slots] = k (in place), encoded as the
    cache stores it (encode_kv_ref); an int8 cache's new scales go to k_scale/v_scale[slots]."""
    for cache, scale, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        stored, row_scale = encode_kv_ref(x, cache.dtype, scale)
        cache[slots] = stored
        if row_scale is not None:
            scale[slots] = row_scale


def rotary_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hk, D] -> q rotated; k rotated and v stored at slots [N] (store_kv_ref)."""
    store_kv_ref(k_cache, v_cache, apply_rotary_ref(k, cos, sin), v, slots, k_scale=k_scale, v_scale=v_scale)
    return apply_rotary_ref(q, cos, sin)


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_q_start: torch.Tensor,
    b_q_len: torch.Tensor,
    b_seq_len: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,  # grid size for the Triton kernel; unused here
    out: torch.Tensor | None = None,
    window: int = 0,
    key_ends: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed ("nopad") sequences whose K/V are already stored in the cache.

    q: [N, Hq, D] packed queries; sequence b owns rows b_q_start[b] : b_q_start[b] + b_q_len[b], which are its last
    b_q_len[b] tokens out of b_seq_len[b] (the rest is an already-cached prefix). Its keys/values are the slots
    req_to_token[b_req_idx[b], :b_seq_len[b]]. Query j of sequence b sits at absolute position
    b_seq_len[b] - b_q_len[b] + j and sees keys 0..that position. GQA: query head h reads KV head h // (Hq // Hk).
    Returns [N, Hq, D] in q's dtype; softmax in fp32.

    window > 0 (a sliding-window layer): query position p sees only keys past p - window. key_ends [N] (bidirectional
    blocks, Gemma 3's image tokens): each query sees the keys before max(key_ends[row], p + 1) instead of those up to
    p, so a block's tokens see each other in both directions; the window still applies (HF's sliding mask is
    window AND (causal OR block)).
    """
    out = torch.empty_like(q) if out is None else out
    group = q.shape[1] // k_cache.shape[1]
    for b in range(b_req_idx.shape[0]):
        start, q_len, seq_len = int(b_q_start[b]), int(b_q_len[b]), int(b_seq_len[b])
        if q_len == 0:
            continue
        slots = req_to_token[int(b_req_idx[b]), :seq_len].long()
        k = decode_kv_ref(k_cache[slots], slots, k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = decode_kv_ref(v_cache[slots], slots, v_scale).repeat_interleave(group, dim=1)
        qb = q[start : start + q_len].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [Hq, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        ends = q_pos + 1
        if key_ends is not None:
            ends = torch.maximum(ends, key_ends[start : start + q_len].to(q_pos.device, torch.int64))
        keys = torch.arange(seq_len, device=q.device)[None, :]
        mask = keys >= ends[:, None]  # [q_len, L]
        if window > 0:
            mask |= keys <= q_pos[:, None] - window
        scores.masked_fill_(mask[None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_seq_len: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,  # bounds the Triton kernel's key chunks; unused here
    out: torch.Tensor | None = None,
    window: int = 0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence. q: [B, Hq, D]; sequence b attends to all its b_seq_len[b] cached tokens (window > 0:
    the last `window` of them), read through req_to_token[b_req_idx[b]]. Returns [B, Hq, D]."""
    n = q.shape[0]
    return prefill_attention_ref(
        q,
        k_cache,
        v_cache,
        req_to_token,
        b_req_idx,
        torch.arange(n, device=q.device, dtype=torch.int32),
        torch.ones(n, device=q.device, dtype=torch.int32),
        b_seq_len,
        scale,
        out=out,
        window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def splice_embeddings_ref(inputs_embeds: torch.Tensor, mm_embeds: torch.Tensor, mm_positions: torch.Tensor) -> None:
    """inputs_embeds: [N, H]; mm_embeds: [M, H]; mm_positions: [M] -> inputs_embeds[mm_positions] = mm_embeds."""
    inputs_embeds[mm_positions] = mm_embeds.to(inputs_embeds.dtype)
