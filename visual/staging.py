"""A reusable host buffer for the visual process's bulk copies: the batch's pixels on their way to the GPU, and its
embeddings on their way back to the shared-memory cache.

Pinned (page-locked) when the device is CUDA, so that a copy is one asynchronous DMA at full bus speed instead of
the driver's synchronous bounce through its own pinned chunks. Pinning is slow (tens of ms for 100 MB), so the buffer
is kept and only grows. Before it is handed out again, the copy that last used it is waited for (a CUDA event), so a
caller can never overwrite bytes still in flight.

The bulk host copies of a batch (the pixels out of the workers' segments, the embeddings into their new segments)
are spread over a few threads (`in_parallel`): each image's pages fault in on its first touch, ~0.3-0.7 ms per MB on
one core, so sixteen 336 px images cost 15-35 ms of one thread between two tower batches. torch's copies release
the GIL, so the threads run side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

_GROWTH = 2.0  # headroom when growing: batch sizes rise one by one under load, and each re-pin stalls the tower
_COPY_THREADS = 4
_PARALLEL_MIN_BYTES = 4 << 20  # below this a batch's copy is not worth the hand-offs

T = TypeVar("T")
_copier: ThreadPoolExecutor | None = None


def in_parallel(fn: Callable[[T], object], items: Iterable[T]) -> None:
    """fn(item) for every item, on the copy threads (inline for a single item). Returns once every call has ended,
    so that nothing still writes when a failure is reported; then re-raises the first error, in item order."""
    items = list(items)
    if len(items) < 2:
        for item in items:
            fn(item)
        return
    global _copier
    if _copier is None:
        _copier = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="visual-copy")
    futures = [_copier.submit(_in_inference_mode, fn, item) for item in items]
    wait(futures)
    for future in futures:
        future.result()


def _in_inference_mode(fn: Callable[[T], object], item: T) -> object:
    """Threads do not inherit inference mode, and the buffers the tower's batch uses are inference tensors (which
    only inference mode may write into)."""
    with torch.inference_mode():
        return fn(item)


class HostStaging:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # [nbytes] uint8
        self._last_use: torch.cuda.Event | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A `shape` tensor over the buffer (its old contents are garbage), pinned if `device` is CUDA."""
        self.wait()
        pin = device.type == "cuda"
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        buf = self._buffer
        if buf is None or buf.numel() < nbytes or buf.is_pinned() != pin:
            buf = torch.empty(max(int(nbytes * _GROWTH), 1), dtype=torch.uint8, pin_memory=pin)
            self._buffer = buf
        return buf[:nbytes].view(dtype).view(shape)

    def fence(self, device: torch.device) -> None:
        """Mark the work queued so far on the device's current stream as the buffer's last use."""
        if device.type == "cuda":
            self._last_use = torch.cuda.Event()
            self._last_use.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Block until the buffer's last recorded use has finished (returns at once on CPU)."""
        if self._last_use is not None:
            self._last_use.synchronize()
            self._last_use = None

    def cat(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Concatenate host tensors along dim 0 into the buffer (one pass over the bytes); the caller uploads the
        result with `.to(device, non_blocking=True)` and then calls `fence(device)`."""
        if device.type != "cuda":
            return torch.cat(tensors, dim=0)  # nothing to pin for; do not hold on to the memory
        rows = sum(t.shape[0] for t in tensors)
        return gather_rows(self.take((rows, *tensors[0].shape[1:]), tensors[0].dtype, device), tensors)


def gather_rows(out: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """out [sum of rows, ...] = the tensors one after another; a large batch's copies on the copy threads."""
    if out.numel() * out.element_size() < _PARALLEL_MIN_BYTES:
        return torch.cat(tensors, dim=0, out=out)
    parts = torch.split(out, [t.shape[0] for t in tensors])
    in_parallel(lambda pair: pair[0].copy_(pair[1]), zip(parts, tensors, strict=True))
    return out
