"""Quantized KV caches as the kernels see them (--llm_kv_type): the scheme a cache's dtype names, the checks on its
scales, and the constants the store kernel, the attention tiles and their torch references share.

int8 (per token): each (slot, KV head) row is stored as round(x / s) with s = absmax(row) / 127, and s in an fp32
[S, Hk] table beside the cache, written by the same store. fp8 (per head): x / s clamped to e4m3's +-448, with s a
fixed fp32 [Hk] per layer. Either way a row reads back as stored * s."""

from __future__ import annotations

import torch

from language.kernels.launch_utils import FLOAT_DTYPES, check_dtype, check_shape

KV_PLAIN, KV_INT8_PER_TOKEN, KV_FP8_PER_HEAD = 0, 1, 2  # the kernels' KV_QUANT constexpr
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def kv_quant_scheme(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> int:
    """The scheme of caches k_cache/v_cache [S, Hk, D] (one dtype, checked by the caller), after checking that the
    scales fit it: none for a float cache, fp32 [S, Hk] for int8, fp32 [Hk] for float8 e4m3; contiguous."""
    dtype = k_cache.dtype
    if dtype in FLOAT_DTYPES:
        assert k_scale is None and v_scale is None, f"a {dtype} cache takes no scales"
        return KV_PLAIN
    assert k_scale is not None and v_scale is not None, f"a {dtype} cache needs k_scale and v_scale"
    num_slots, num_kv_heads = k_cache.shape[0], k_cache.shape[1]
    if dtype == torch.int8:
        scheme, shape = KV_INT8_PER_TOKEN, (num_slots, num_kv_heads)
    elif dtype == torch.float8_e4m3fn:
        scheme, shape = KV_FP8_PER_HEAD, (num_kv_heads,)
    else:
        raise AssertionError(f"k_cache: dtype {dtype} is neither a float dtype nor one of {QUANT_DTYPES}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_dtype(name, scale, (torch.float32,))
        check_shape(name, scale, shape)
        assert scale.is_contiguous(), f"{name}: must be contiguous"
    return scheme
