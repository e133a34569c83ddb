"""Pinned host buffers for a step's bulk inputs and outputs, reused from step to step."""

from __future__ import annotations

import torch


class PinnedStaging:
    """Two pinned host buffers used in turn (one may still feed an in-flight copy) and one device buffer, grown on
    demand. On CPU both are plain memory."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64):
        self.device, self.dtype = device, dtype
        self._pin = device.type == "cuda"
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
        self._dev = torch.empty(0, dtype=dtype, device=device)
        self._turn = 0

    def host(self, n: int) -> torch.Tensor:
        self._turn ^= 1
        if self._host[self._turn].numel() < n:
            size = max(1024, 1 << (n - 1).bit_length())
            self._host[self._turn] = torch.empty(size, dtype=self.dtype, pin_memory=self._pin)
        return self._host[self._turn][:n]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        n = host.numel()
        if self._dev.numel() < n:
            self._dev = torch.empty(max(1024, 1 << (n - 1).bit_length()), dtype=self.dtype, device=self.device)
        dev = self._dev[:n]
        dev.copy_(host, non_blocking=True)
        return dev
