"""Checks, sizing and launch options shared by the Triton launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests without a GPU); otherwise they need CUDA tensors.
_INTERPRET_ENV = "TRITON_INTERPRET"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the tensor cores' 16-bit operands
INDEX_DTYPES = (torch.int32, torch.int64)
_QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)  # kv_quant.QUANT_DTYPES (which imports this module)


def interpreting() -> bool:
    return os.environ.get(_INTERPRET_ENV, "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 dot operands as raw bits (garbage), so there the operands are upcast
    after rounding; compiled kernels always use the tensor cores in the input dtype."""
    return interpreting() and dtype == torch.bfloat16


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may have its programs scheduled while the
# kernel before it in the stream drains, instead of after it has finished; the kernels take USE_PDL and then run
# `griddepcontrol.wait` (gdc_wait) before they read or write anything an earlier kernel writes, and signal
# `launch_dependents` early. CUDA graphs capture such launches as programmatic edges. The engine sets the switch for
# its process from --disable_pdl (set_pdl); the interpreter has no griddepcontrol, and pre-Hopper GPUs no PDL.
_PDL_MIN_CAPABILITY = (9, 0)
PDL_ON = {"USE_PDL": True, "launch_pdl": True}  # a kernel's constexpr and the launch attribute, always together
PDL_OFF = {"USE_PDL": False, "launch_pdl": False}
_pdl_wanted = True
_pdl_by_device: dict[torch.device, bool] = {}  # the decision per device: launches ask hundreds of times a step


def set_pdl(enabled: bool) -> None:
    """Whether this process's kernels use PDL where the device supports it (the engine's --disable_pdl)."""
    global _pdl_wanted
    _pdl_wanted = enabled
    _pdl_by_device.clear()


def pdl_supported(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or more, with the kernels compiled (not interpreted)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= _PDL_MIN_CAPABILITY


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: the switch on and the device able."""
    decided = _pdl_by_device.get(device)
    if decided is None:
        decided = _pdl_by_device[device] = _pdl_wanted and pdl_supported(device)
    return decided


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A PDL kernel's barrier, before its first read of anything an earlier kernel writes and its first write: wait
    until the kernel before it has finished and its writes are visible (and so every kernel before that: each waited
    in turn, and a kernel launched without PDL only starts once its predecessor has finished). Then let the next
    kernel's programs be scheduled: they only wait on SMs this kernel leaves free, and signalling here, not before
    the wait, keeps at most one kernel queued behind the running one. Every program calls it unconditionally,
    before any early return: a kernel may only finish after the one before it has."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch keywords that turn PDL on or off for a kernel with a USE_PDL constexpr: `kernel[grid](...,
    **pdl_launch(device))`."""
    return PDL_ON if use_pdl(device) else PDL_OFF


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, which is CUDA unless the Triton interpreter runs. Returns that device."""
    # These checks run on every launch, hundreds of times in an eager step: plain loops, messages only on failure.
    rest = iter(tensors.values())
    first = next(rest).device
    for t in rest:
        if t.device != first:
            raise AssertionError(f"tensors on different devices: { {n: t.device for n, t in tensors.items()} }")
    assert first.type == "cuda" or interpreting(), (
        f"Triton kernels need CUDA tensors (got {first}); set {_INTERPRET_ENV}=1 to run them on CPU"
    )
    return first


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    assert t.dtype in allowed, f"{name}: dtype {t.dtype} not in {allowed}"


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` entries of None match any size."""
    got = t.shape
    if len(got) == len(shape):
        for i, want in enumerate(shape):  # not zip(..., strict=...): its keyword alone costs ~0.2 µs a call
            if want is not None and got[i] != want:
                break
        else:
            return
    raise AssertionError(f"{name}: shape {tuple(got)} does not match {shape} (None = any)")


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels take any outer strides but read the last dimension as one contiguous row."""
    assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}: last dimension must be contiguous (strides {t.stride()})"


def check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    assert out.shape == shape, f"out: shape {tuple(out.shape)}, expected {shape}"
    assert out.dtype == dtype, f"out: dtype {out.dtype}, expected {dtype}"
    assert out.device == device, f"out: on {out.device}, expected {device}"
    assert out.is_contiguous(), "out: must be contiguous"


def check_linear_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    rows: int | None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> tuple[torch.device, int, int]:
    """F.linear's operands for a kernel: x [rows (None: any), K] of one of `dtypes`, weight [N, K] and bias [N]
    of x's dtype, each read as contiguous rows. Returns (device, N, K)."""
    device = check_device(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    check_dtype("x", x, dtypes)
    check_shape("x", x, (rows, None))
    num_out, k = weight.shape
    check_shape("weight", weight, (None, x.shape[1]))
    check_dtype("weight", weight, (x.dtype,))
    check_inner_contiguous("x", x)
    check_inner_contiguous("weight", weight)
    if bias is not None:
        check_shape("bias", bias, (num_out,))
        check_dtype("bias", bias, (x.dtype,))
        check_inner_contiguous("bias", bias)
    return device, num_out, k


def check_attention_operands(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor
) -> tuple[int, int, int]:
    """The checks both attention launchers share: q [*, Hq, D] and K/V caches [S, Hk, D] of one float dtype with
    Hq a multiple of Hk, an integer slot table [R, L], rows read as contiguous. Returns (Hq, Hk, D)."""
    check_dtype("q", q, FLOAT_DTYPES)
    check_shape("q", q, (None, None, None))
    _, num_heads, head_dim = q.shape
    assert head_dim >= 1, "empty head dim"
    check_shape("k_cache", k_cache, (None, None, head_dim))
    num_kv_heads = k_cache.shape[1]
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    # A quantized cache (int8, float8 e4m3: kv_quant.py) is read into q's dtype by the kernels.
    assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == q.dtype or k_cache.dtype in _QUANT_KV_DTYPES), (
        f"q, k_cache, v_cache must share a dtype, or the caches be int8/float8 (got {q.dtype}, {k_cache.dtype}, "
        f"{v_cache.dtype})"
    )
    assert num_heads % num_kv_heads == 0, f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}"
    check_shape("req_to_token", req_to_token, (None, None))
    check_dtype("req_to_token", req_to_token, INDEX_DTYPES)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("req_to_token", req_to_token)):
        check_inner_contiguous(name, t)
    return num_heads, num_kv_heads, head_dim


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a jit function: slow to call from Python on every launch)."""
    return -(-a // b)


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(n), floor)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small fixed number for the interpreter."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
