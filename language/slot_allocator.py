"""Token-granular KV slot allocation (TokenAttention): a stack of free slot indices.

Allocation and freeing are O(n) in the slots moved, never in the cache size: a 7B model on an 80 GB card has close
to a million slots, and a pass over all of them per step (as a free-mask scan would be) costs milliseconds of host
time per token. A used-mask of the same size catches double frees exactly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.ma  # noqa: F401  np.unique (free's double-free check) imports it on first use: in a step


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        """Every slot free."""
        num_slots = self.num_slots
        # The top of the stack is the end of the array; slot 0 is handed out first.
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int64)  # [num_slots]
        self._top = num_slots  # free slots are _stack[:_top]
        self._used = np.zeros(num_slots, dtype=np.bool_)  # [num_slots]

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_slots - self._top

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    def allocate(self, n: int) -> np.ndarray:
        """n distinct free slots as an int64 array [n]; raises OutOfSlots (changing nothing) if fewer are free."""
        if n > self._top:
            raise OutOfSlots(f"asked for {n} KV slots, {self._top} free")
        slots = self._stack[self._top - n : self._top][::-1].copy()  # ascending when the stack is fresh
        self._top -= n
        self._used[slots] = True
        return slots

    def free(self, slots: Sequence[int] | np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        if not self._used[slots].all() or np.unique(slots).size != slots.size:
            raise ValueError("freeing a slot that is already free")
        self._used[slots] = False
        self._stack[self._top : self._top + slots.size] = slots[::-1]
        self._top += slots.size
