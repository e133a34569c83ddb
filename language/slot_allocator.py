"""Token-granular KV slot allocation (TokenAttention): a free mask over every slot of the preallocated cache.

Allocation prefers one contiguous run (good for kernel locality) and falls back to scattered free slots. Every
operation is a tensor operation over the mask; the free count is kept exactly."""

from __future__ import annotations

import torch


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = torch.ones(num_slots, dtype=torch.bool)  # [num_slots] True = free
        self._num_free = num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> torch.Tensor:
        """n slots as an int64 tensor [n]; raises OutOfSlots (changing nothing) if fewer than n are free."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if n > self._num_free:
            raise OutOfSlots(f"asked for {n} KV slots, {self._num_free} free")
        slots = self._contiguous_run(n)
        if slots is None:
            slots = self._free.nonzero().squeeze(1)[:n]
        self._free[slots] = False
        self._num_free -= n
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.cpu().long()
        if bool(self._free[slots].any()) or slots.unique().numel() != slots.numel():
            raise ValueError("freeing a slot that is already free")
        self._free[slots] = True
        self._num_free += slots.numel()

    def _contiguous_run(self, n: int) -> torch.Tensor | None:
        """The first run of n consecutive free slots, if any."""
        if n > self.num_slots:
            return None
        csum = torch.cumsum(self._free, 0, dtype=torch.int32)  # [num_slots]
        window = csum[n - 1 :].clone()  # free count of window [i, i + n)
        window[1:] -= csum[:-n]
        hits = (window == n).nonzero()
        if hits.numel() == 0:
            return None
        start = int(hits[0])
        return torch.arange(start, start + n, dtype=torch.int64)
