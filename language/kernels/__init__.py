"""Kernel entry points used by the models. Each dispatches to its Triton kernel on CUDA tensors and to the
plain-torch reference otherwise (CPU, CI)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from language.kernels import reference, sampling_reference
from language.kernels.decode_attention import decode_attention as _decode_attention_triton
from language.kernels.embed_splice import splice_embeddings as _splice_embeddings_triton
from language.kernels.fp8_quant import InputForm, MeasuredRows, QuantizedRows
from language.kernels.gemma_norm import gemma_norm_add_norm as _gemma_norm_add_norm_triton
from language.kernels.gemma_norm import gemma_rms_norm as _gemma_rms_norm_triton
from language.kernels.gemv import gemv
from language.kernels.greedy_sample import greedy_sample as _greedy_sample_triton
from language.kernels.head_rms_norm import qk_rms_norm as _qk_rms_norm_triton
from language.kernels.kv_store import store_kv as _store_kv_triton
from language.kernels.launch_utils import HALF_DTYPES
from language.kernels.nucleus_draw import nucleus_draw as _nucleus_draw_triton
from language.kernels.penalties import penalize as _penalize_triton
from language.kernels.prefill_attention import prefill_attention as _prefill_attention_triton
from language.kernels.rms_norm import add_rms_norm as _add_rms_norm_triton
from language.kernels.rms_norm import add_rms_norm_fp8 as _add_rms_norm_fp8_triton
from language.kernels.rms_norm import add_rms_norm_measured as _add_rms_norm_measured_triton
from language.kernels.rms_norm import rms_norm as _rms_norm_triton
from language.kernels.rms_norm import rms_norm_fp8 as _rms_norm_fp8_triton
from language.kernels.rms_norm import rms_norm_measured as _rms_norm_measured_triton
from language.kernels.rotary import apply_rotary as _apply_rotary_triton
from language.kernels.rotary import mrope_cos_sin as _mrope_cos_sin_triton
from language.kernels.rotary import rotary_cos_sin as _rotary_cos_sin_triton
from language.kernels.rotary_store import rotary_store_kv as _rotary_store_kv_triton
from language.kernels.silu_mul import gelu_tanh_and_mul as _gelu_tanh_and_mul_triton
from language.kernels.silu_mul import gelu_tanh_and_mul_fp8 as _gelu_tanh_and_mul_fp8_triton
from language.kernels.silu_mul import gelu_tanh_and_mul_measured as _gelu_tanh_and_mul_measured_triton
from language.kernels.silu_mul import silu_and_mul as _silu_and_mul_triton
from language.kernels.silu_mul import silu_and_mul_fp8 as _silu_and_mul_fp8_triton
from language.kernels.silu_mul import silu_and_mul_measured as _silu_and_mul_measured_triton
from language.kernels.skinny_gemm import skinny_gemm
from language.kernels.skinny_launches import SKINNY_MAX_ROWS, launch_for


def _dispatch(triton_fn: Callable, reference_fn: Callable) -> Callable:
    """Run `triton_fn` when the first argument is a CUDA tensor, else `reference_fn`. The Triton launchers take extra
    optional keywords: launch hints (max_q_len, max_seq_len) are dropped on the reference path, and an `out=` buffer
    is filled from the reference's result so both paths return (and write) the same thing."""
    reference_params = set(inspect.signature(reference_fn).parameters)

    @functools.wraps(triton_fn)
    def run(first: torch.Tensor, *args, **kwargs):
        if first.is_cuda:
            return triton_fn(first, *args, **kwargs)
        out = kwargs.pop("out", None)
        result = reference_fn(first, *args, **{k: v for k, v in kwargs.items() if k in reference_params})
        if out is None:
            return result
        if isinstance(out, tuple):
            return tuple(o.copy_(r) for o, r in zip(out, result, strict=True))
        return out.copy_(result)

    return run


rms_norm = _dispatch(_rms_norm_triton, reference.rms_norm_ref)
add_rms_norm = _dispatch(_add_rms_norm_triton, reference.add_rms_norm_ref)
qk_rms_norm = _dispatch(_qk_rms_norm_triton, reference.qk_rms_norm_ref)
gemma_rms_norm = _dispatch(_gemma_rms_norm_triton, reference.gemma_rms_norm_ref)
gemma_norm_add_norm = _dispatch(_gemma_norm_add_norm_triton, reference.gemma_norm_add_norm_ref)
silu_and_mul = _dispatch(_silu_and_mul_triton, reference.silu_and_mul_ref)
gelu_tanh_and_mul = _dispatch(_gelu_tanh_and_mul_triton, reference.gelu_tanh_and_mul_ref)
# The same, writing their rows quantized per token for an FP8 linear (fp8_quant.QuantizedRows).
rms_norm_fp8 = _dispatch(_rms_norm_fp8_triton, reference.rms_norm_fp8_ref)
add_rms_norm_fp8 = _dispatch(_add_rms_norm_fp8_triton, reference.add_rms_norm_fp8_ref)
silu_and_mul_fp8 = _dispatch(_silu_and_mul_fp8_triton, reference.silu_and_mul_fp8_ref)
gelu_tanh_and_mul_fp8 = _dispatch(_gelu_tanh_and_mul_fp8_triton, reference.gelu_tanh_and_mul_fp8_ref)
# The same, writing their rows with each row's largest magnitude for a decode batch's FP8 linear (MeasuredRows).
rms_norm_measured = _dispatch(_rms_norm_measured_triton, reference.rms_norm_measured_ref)
add_rms_norm_measured = _dispatch(_add_rms_norm_measured_triton, reference.add_rms_norm_measured_ref)
silu_and_mul_measured = _dispatch(_silu_and_mul_measured_triton, reference.silu_and_mul_measured_ref)
gelu_tanh_and_mul_measured = _dispatch(_gelu_tanh_and_mul_measured_triton, reference.gelu_tanh_and_mul_measured_ref)
# The kernel before a linear, by the form the linear takes its rows in (InputForm).
RMS_NORM_FOR = {InputForm.QUANTIZED: rms_norm_fp8, InputForm.MEASURED: rms_norm_measured}  # PLAIN: the RMSNorm module
ADD_RMS_NORM_FOR = {
    InputForm.PLAIN: add_rms_norm,
    InputForm.QUANTIZED: add_rms_norm_fp8,
    InputForm.MEASURED: add_rms_norm_measured,
}
SILU_AND_MUL_FOR = {
    InputForm.PLAIN: silu_and_mul,
    InputForm.QUANTIZED: silu_and_mul_fp8,
    InputForm.MEASURED: silu_and_mul_measured,
}
GELU_TANH_AND_MUL_FOR = {
    InputForm.PLAIN: gelu_tanh_and_mul,
    InputForm.QUANTIZED: gelu_tanh_and_mul_fp8,
    InputForm.MEASURED: gelu_tanh_and_mul_measured,
}
rotary_cos_sin = _dispatch(_rotary_cos_sin_triton, reference.rotary_cos_sin_ref)
mrope_cos_sin = _dispatch(_mrope_cos_sin_triton, reference.mrope_cos_sin_ref)
apply_rotary = _dispatch(_apply_rotary_triton, reference.apply_rotary_ref)
store_kv = _dispatch(_store_kv_triton, reference.store_kv_ref)
# The two above in one launch: q and k rotated, k and v stored (a layer's step before its attention).
rotary_store_kv = _dispatch(_rotary_store_kv_triton, reference.rotary_store_kv_ref)
prefill_attention = _dispatch(_prefill_attention_triton, reference.prefill_attention_ref)
decode_attention = _dispatch(_decode_attention_triton, reference.decode_attention_ref)
splice_embeddings = _dispatch(_splice_embeddings_triton, reference.splice_embeddings_ref)
# The argmax and its log-probability, read from the LM head's logits in their own dtype.
greedy_sample = _dispatch(_greedy_sample_triton, sampling_reference.greedy_sample_ref)
# Repetition, frequency and presence penalties from the engine's per-request tables, in one pass.
penalize = _dispatch(_penalize_triton, sampling_reference.penalize_ref)
# A top-p / min-p draw over the whole vocabulary, without sorting it.
nucleus_draw = _dispatch(_nucleus_draw_triton, sampling_reference.nucleus_draw_ref)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row on CUDA (a batch-1 decode step): the GEMV kernel reads the weights faster than cuBLAS does."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and x.dtype == weight.dtype


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """2 to SKINNY_MAX_ROWS rows of bf16/fp16 on CUDA (decode batches) of a weight shape at whose row count the
    weight-streaming GEMM measured faster than cuBLAS (skinny_launches.launch_for)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 2 <= x.shape[0] <= SKINNY_MAX_ROWS
        and x.stride(-1) == 1
        and x.dtype == weight.dtype
        and x.dtype in HALF_DTYPES
        and launch_for(x.shape[0], weight.shape[0], weight.shape[1], weight.element_size()) is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (x [n, K], weight [N, K] -> [n, N]), through the GEMV kernel where `gemv_applies`, the
    weight-streaming GEMM where `skinny_applies`."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    if skinny_applies(x, weight):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


__all__ = [
    "ADD_RMS_NORM_FOR",
    "GELU_TANH_AND_MUL_FOR",
    "RMS_NORM_FOR",
    "SILU_AND_MUL_FOR",
    "SKINNY_MAX_ROWS",
    "InputForm",
    "MeasuredRows",
    "QuantizedRows",
    "add_rms_norm",
    "add_rms_norm_fp8",
    "add_rms_norm_measured",
    "apply_rotary",
    "decode_attention",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_fp8",
    "gelu_tanh_and_mul_measured",
    "gemma_norm_add_norm",
    "gemma_rms_norm",
    "gemv",
    "gemv_applies",
    "greedy_sample",
    "linear",
    "mrope_cos_sin",
    "nucleus_draw",
    "penalize",
    "prefill_attention",
    "qk_rms_norm",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_measured",
    "rotary_cos_sin",
    "rotary_store_kv",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "silu_and_mul_measured",
    "skinny_applies",
    "skinny_gemm",
    "splice_embeddings",
    "store_kv",
]
