"""Each step's inputs, from rank 0 (the engine) to the other ranks.

The engine schedules once; every step it packs the step's integers into one host buffer (ModelRunner), and that
buffer is what the other ranks get: one broadcast over the host (gloo) group of a fixed-size message, a header and
the buffer inline (every decode step fits; a prefill step whose integers do not fit sends the rest in a second
broadcast). The other ranks then run the same forward on the same KV slots, so their caches stay in step with
rank 0's allocator by construction. Tensors that live on rank 0's device (a step's image rows; the samples of a
step that is not all greedy) are broadcast on the device group; greedy samples need nothing: every rank has the
gathered logits and takes the same argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from language.parallel.group import TPGroup

STOP, EAGER, GRAPH = 0, 1, 2
_HEADER = 16  # int64: kind, payload length, then the kind's fields
_INLINE = 4096  # int64 of payload carried in the message itself (a 256-row decode graph step needs 1024)


@dataclass
class StepMessage:
    kind: int
    fields: list[int]
    payload: torch.Tensor  # int64 [length], host


class StepChannel:
    def __init__(self, tp: TPGroup):
        self.tp = tp
        self._msg = torch.zeros(_HEADER + _INLINE, dtype=torch.int64)  # [HEADER + INLINE], host

    # ---- rank 0 ----
    def send(self, kind: int, fields: list[int], payload: torch.Tensor | None = None) -> None:
        n = 0 if payload is None else payload.numel()
        if 2 + len(fields) > _HEADER:
            raise ValueError("step header too long")
        msg = self._msg
        msg[0], msg[1] = kind, n
        msg[2 : 2 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        if 0 < n <= _INLINE:
            msg[_HEADER : _HEADER + n] = payload
        dist.broadcast(msg, 0, group=self.tp.cpu_group)
        if n > _INLINE:
            dist.broadcast(payload.contiguous(), 0, group=self.tp.cpu_group)

    def stop(self) -> None:
        self.send(STOP, [])

    # ---- other ranks ----
    def recv(self, num_fields: int = _HEADER - 2) -> StepMessage:
        msg = self._msg
        dist.broadcast(msg, 0, group=self.tp.cpu_group)
        kind, n = int(msg[0]), int(msg[1])
        fields = msg[2 : 2 + num_fields].tolist()
        if n <= _INLINE:
            payload = msg[_HEADER : _HEADER + n]
        else:
            payload = torch.empty(n, dtype=torch.int64)
            dist.broadcast(payload, 0, group=self.tp.cpu_group)
        return StepMessage(kind, fields, payload)

    # ---- both ----
    def share(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype on each), on the device group."""
        dist.broadcast(t, 0, group=self.tp.device_group)
        return t
