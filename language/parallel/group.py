"""The tensor-parallel group of one rank: its rank and size, the device group that the model's collectives run on
(NCCL on GPUs, gloo on CPU) and a gloo group on the host that carries each step's inputs from rank 0."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The host group waits for rank 0's next step however long the server stays idle; a dead rank is caught by the
# parent polling its processes, not by this timeout.
_CONTROL_TIMEOUT = timedelta(days=365)
# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there); older ones have only that.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: object | None = None  # dist.ProcessGroup: the model's all-reduce and all-gather
    cpu_group: object | None = None  # dist.ProcessGroup (gloo): step inputs and start-up agreements

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (capturable in a CUDA graph on NCCL)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over ranks, in place (at load: FP8 scales of a row-parallel weight's whole rows)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[n, m] on each rank -> [n, size * m], rank r's block at columns [r*m, (r+1)*m), on every rank."""
        if self.size == 1:
            return x
        n, m = x.shape
        out = x.new_empty((self.size * n, m))  # [size * n, m]: rank r's rows at [r*n, (r+1)*n)
        _all_gather(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, n, m).permute(1, 0, 2).reshape(n, self.size * m)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV slots each rank's memory allows)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_tp(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0) -> TPGroup:
    """Join the group (every rank calls this; rank 0 also hosts the rendezvous store at init_method)."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    logger.info("tensor parallel rank %d/%d: joining %s (%s)", rank, size, init_method, backend)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    cpu_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    group = TPGroup(rank, size, dist.group.WORLD, cpu_group)
    if device.type == "cuda":  # NCCL connects lazily: do it now, not inside the first graph capture
        group.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    logger.info("tensor parallel rank %d/%d ready", rank, size)
    return group
