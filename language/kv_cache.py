"""The KV cache: one preallocated K and V buffer per layer with a slot per token, the slot allocator, and the
request-to-slots table that attention kernels read through. The table lives on the device and is written by the
forward pass itself (from the step's packed inputs); the host keeps each request's slots in `Request.kv_slots`,
so freeing never reads the device back.

Quantized K/V (--llm_kv_type): int8kv stores int8 rows with an fp32 scale per (slot, KV head), computed when the row
is stored (absmax / 127); fp8kv stores float8 e4m3 rows with one fp32 scale per KV head and layer (1.0: uncalibrated,
as vLLM's default k_scale; values clamp to +-448). Scales sit beside the rows, allocated once (captured graphs read
them), and per-slot scales belong to their slot, so the prefix cache shares a quantized slot as it shares any other."""

from __future__ import annotations

import torch

from language.slot_allocator import SlotAllocator

# --llm_kv_type (normalised by language/options.py) -> the dtype K and V are stored in; None: the model's.
KV_STORAGE_DTYPES: dict[str, torch.dtype | None] = {"None": None, "int8kv": torch.int8, "fp8kv": torch.float8_e4m3fn}
_SCALE_DTYPE = torch.float32


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
        kv_type: str = "None",
    ):
        """dtype: the model's (queries and attention outputs); kv_type: how K and V are stored (KV_STORAGE_DTYPES)."""
        # One extra slot and one extra row, never allocated: padded rows of a captured decode batch write to and
        # read from them, so padding never touches a live request's cache.
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.kv_type = kv_type
        self.storage_dtype = KV_STORAGE_DTYPES[kv_type] or dtype
        self.k = [torch.zeros(shape, dtype=self.storage_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=self.storage_dtype, device=device) for _ in range(num_layers)]
        # Per layer: [slots+1, Hk] (int8kv, written by each store), [Hk] (fp8kv, fixed) or None (unquantized).
        self.k_scale = [self._scales(num_slots + 1, num_kv_heads, device) for _ in range(num_layers)]
        self.v_scale = [self._scales(num_slots + 1, num_kv_heads, device) for _ in range(num_layers)]
        self.slot_bytes = self.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, kv_type)
        self.slots = SlotAllocator(num_slots)
        self.dummy_slot, self.dummy_row = num_slots, max_requests
        self.max_req_len = max_req_len
        self.dtype = dtype
        # Row r, column p: the slot holding token p of the request in row r.
        self.req_to_token = torch.full((max_requests + 1, max_req_len), num_slots, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def _scales(self, rows: int, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        if self.kv_type == "int8kv":
            return torch.zeros((rows, num_kv_heads), dtype=_SCALE_DTYPE, device=device)
        if self.kv_type == "fp8kv":
            return torch.ones((num_kv_heads,), dtype=_SCALE_DTYPE, device=device)
        return None

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer i's (k, v, k_scale, v_scale): what the store and attention kernels take."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_type: str = "None"
    ) -> int:
        """Bytes one token slot takes over all layers: its K and V rows, and int8kv's scale per KV head (fp8kv's
        per-head scales are per layer, not per token)."""
        storage = KV_STORAGE_DTYPES[kv_type] or dtype
        per_head = head_dim * storage.itemsize
        if kv_type == "int8kv":
            per_head += _SCALE_DTYPE.itemsize
        return 2 * num_layers * num_kv_heads * per_head

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
