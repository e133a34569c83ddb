"""Kernel entry points used by the models. Each dispatches to its Triton kernel on CUDA tensors and to the
plain-torch reference otherwise (CPU, CI)."""

from language.kernels.reference import (
    apply_rotary_ref as apply_rotary,
    decode_attention_ref as decode_attention,
    mrope_cos_sin_ref as mrope_cos_sin,
    prefill_attention_ref as prefill_attention,
    rms_norm_ref as rms_norm,
    rotary_cos_sin_ref as rotary_cos_sin,
    silu_and_mul_ref as silu_and_mul,
    splice_embeddings_ref as splice_embeddings,
    store_kv_ref as store_kv,
)

__all__ = [
    "apply_rotary",
    "decode_attention",
    "mrope_cos_sin",
    "prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "silu_and_mul",
    "splice_embeddings",
    "store_kv",
]
