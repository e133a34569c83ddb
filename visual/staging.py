"""A reusable host buffer for the visual process's bulk copies: the batch's pixels on their way to the GPU, and its
embeddings on their way back to the shared-memory cache.

Pinned (page-locked) when the device is CUDA, so that a copy is one asynchronous DMA at full bus speed instead of
the driver's synchronous bounce through its own pinned chunks. Pinning is slow (tens of ms for 100 MB), so the buffer
is kept and only grows. Before it is handed out again, the copy that last used it is waited for (a CUDA event), so a
caller can never overwrite bytes still in flight.
"""

from __future__ import annotations

import torch

_GROWTH = 2.0  # headroom when growing: batch sizes rise one by one under load, and each re-pin stalls the tower


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
        out = self.take((rows, *tensors[0].shape[1:]), tensors[0].dtype, device)
        return torch.cat(tensors, dim=0, out=out)
