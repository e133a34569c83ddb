"""CUDA graphs for decode steps: one graph per padded batch size, captured once, replayed with the step's inputs
copied into static buffers. Decode is launch-bound at small batch; a replay costs one launch."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from language.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from language.model_runner import ModelRunner


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int):
        self.model = runner.model
        kv = runner.kv
        self.sizes = graph_batch_sizes(min(max_batch, kv.num_free_rows()))
        n, dev = self.sizes[-1], runner.device
        dims = self.model.position_dims
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros((dims, n) if dims > 1 else (n,), dtype=torch.int64, device=dev)
        self.out_slots = torch.full((n,), kv.dummy_slot, dtype=torch.int64, device=dev)
        self.req_idx = torch.full((n,), kv.dummy_row, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.arange = torch.arange(n, dtype=torch.int32, device=dev)
        self.kv = kv
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            is_prefill=False,
            input_ids=self.input_ids[:bs],
            positions=self.positions[..., :bs],
            out_slots=self.out_slots[:bs],
            req_idx=self.req_idx[:bs],
            seq_lens=self.seq_lens[:bs],
            q_starts=self.arange[:bs],
            q_lens=torch.ones_like(self.arange[:bs]),
            logits_idx=self.arange[:bs].long(),
            max_q_len=1,
            kv=self.kv,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            batch = self._static_batch(bs)
            self.model(batch)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self.model(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[..., :n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.req_idx[:n].copy_(batch.req_idx)
        self.seq_lens[:n].copy_(batch.seq_lens)
        # Padding rows point at the dummy row/slot, never at a live request.
        self.out_slots[n:bs].fill_(self.kv.dummy_slot)
        self.req_idx[n:bs].fill_(self.kv.dummy_row)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
