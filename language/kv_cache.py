"""The KV cache: one preallocated K and V buffer per layer with a slot per token, the slot allocator, and the
request-to-slots table that attention kernels read through. The table lives on the device and is written by the
forward pass itself (from the step's packed inputs); the host keeps each request's slots in `Request.kv_slots`,
so freeing never reads the device back."""

from __future__ import annotations

import torch

from language.slot_allocator import SlotAllocator


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_req_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # One extra slot and one extra row, never allocated: padded rows of a captured decode batch write to and
        # read from them, so padding never touches a live request's cache.
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # [slots+1, Hk, D] each
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = SlotAllocator(num_slots)
        self.dummy_slot, self.dummy_row = num_slots, max_requests
        self.max_req_len = max_req_len
        self.dtype = dtype
        # Row r, column p: the slot holding token p of the request in row r.
        self.req_to_token = torch.full((max_requests + 1, max_req_len), num_slots, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def allocate_row(self) -> int:
        return self._free_rows.pop()

    def assign(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Record that token `positions[i]` of row `rows[i]` lives in `slots[i]` (all [n], on the table's device)."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)

    def reset(self) -> None:
        """Every slot and row free (the engine starts afresh after a failed step)."""
        self.slots.reset()
        self._free_rows = list(range(self.dummy_row - 1, -1, -1))

    def free_row(self, row: int, slots: list[int]) -> None:
        """Free the row and the given slots (the request's host-side record of what it holds)."""
        self.slots.free(slots)
        self._free_rows.append(row)
