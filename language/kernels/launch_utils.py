"""Checks and sizing helpers shared by the Triton launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton

# Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests without a GPU); otherwise they need CUDA tensors.
_INTERPRET_ENV = "TRITON_INTERPRET"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    return os.environ.get(_INTERPRET_ENV, "0") == "1"


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, which is CUDA unless the Triton interpreter runs. Returns that device."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    assert all(d == first for d in devices.values()), f"tensors on different devices: {devices}"
    assert first.type == "cuda" or interpreting(), (
        f"Triton kernels need CUDA tensors (got {first}); set {_INTERPRET_ENV}=1 to run them on CPU"
    )
    return first


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    assert t.dtype in allowed, f"{name}: dtype {t.dtype} not in {allowed}"


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` entries of None match any size."""
    ok = t.dim() == len(shape) and all(want is None or got == want for got, want in zip(t.shape, shape, strict=False))
    assert ok, f"{name}: shape {tuple(t.shape)} does not match {shape} (None = any)"


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels take any outer strides but read the last dimension as one contiguous row."""
    assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}: last dimension must be contiguous (strides {t.stride()})"


def check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    assert out.shape == shape, f"out: shape {tuple(out.shape)}, expected {shape}"
    assert out.dtype == dtype, f"out: dtype {out.dtype}, expected {dtype}"
    assert out.device == device, f"out: on {out.device}, expected {device}"
    assert out.is_contiguous(), "out: must be contiguous"


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
