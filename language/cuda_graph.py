"""CUDA graphs for decode steps: one graph per batch size class, captured once, replayed with the step's inputs
copied into static buffers in one transfer. Decode is launch-bound at small batch; a replay costs one launch.

The graph also does the step's device-side bookkeeping: it reads each row's input id from `last_token` (the
previous step's sample, still on the device), records the stored token's slot in the request-to-slots table, and
samples greedily into `last_token`; a batch that is not all greedy samples again from the logits afterwards."""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from language.forward_batch import ForwardBatch
from language.kernels.precompile import compile_only
from language.kv_cache import KVCache
from language.progress import progress
from language.sampler import sample_greedy
from language.step_inputs import DecodeRows

logger = logging.getLogger(__name__)

# Columns of the static input buffer [max_bs, 4]: batch-major, so the first bs rows are one contiguous copy.
_REQ_IDX, _COL, _POSITION, _SLOT = range(4)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Every size up to 8, then steps of 8 to 64, of 16 to 128 and of 32 beyond (LightLLM's split/grow scheme,
    coarser where a step is long anyway): a batch pads to the next size. Fewer graphs keep start-up short."""
    sizes = list(range(1, 9)) + list(range(16, 65, 8)) + list(range(80, 129, 16)) + list(range(160, max_batch + 1, 32))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: KVCache, last_token: torch.Tensor, graph_max_batch_size: int):
        """last_token: the runner's per-row buffer of the previous step's sample, which the graphs read and write."""
        self.model = model
        self.kv = kv
        self.last_token = last_token
        self.sizes = graph_batch_sizes(min(graph_max_batch_size, kv.num_free_rows()))
        n, dev = self.sizes[-1], last_token.device
        self._host = [torch.empty((n, 4), dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._turn = 0
        self.static = torch.empty((n, 4), dtype=torch.int64, device=dev)  # [max_bs, 4]
        # Padding rows point at the dummy row/slot, never at a live request.
        self._padding_row = np.array([0, 0, 0, 0], dtype=np.int64)
        self._padding_row[_REQ_IDX], self._padding_row[_SLOT] = kv.dummy_row, kv.dummy_slot
        self.static.copy_(torch.from_numpy(np.tile(self._padding_row, (n, 1))))  # what the captures run on
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # logits, ids, logprobs
        self._capture_all()

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def _run(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [bs] each, made contiguous once here: every layer's kernels would otherwise copy the strided columns.
        req_idx, col = self.static[:bs, _REQ_IDX].contiguous(), self.static[:bs, _COL].contiguous()
        slots, position = self.static[:bs, _SLOT].contiguous(), self.static[:bs, _POSITION].contiguous()
        self.kv.assign(req_idx, col, slots)
        dims = self.model.position_dims
        batch = ForwardBatch(
            input_ids=self.last_token[req_idx],
            positions=position if dims == 1 else position[None, :].expand(dims, bs),
            out_slots=slots,
            num_decode=bs,
            req_idx=req_idx,
            decode_seq_lens=col + 1,
            prefill_req_idx=col[:0],
            prefill_seq_lens=col[:0],
            q_starts=col[:0],
            q_lens=col[:0],
            max_q_len=0,
            kv=self.kv,
        )
        logits = self.model(batch)  # [bs, vocab]
        ids, logprobs, *_ = sample_greedy(logits)  # used when the whole batch is greedy; a few launches saved
        self.last_token[req_idx] = ids
        return logits, ids, logprobs

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with compile_only("decode graphs"):  # every size's kernel variants at once, in parallel; nothing runs
            for bs in self.sizes:
                self._run(bs)
        pool = None
        sizes = list(reversed(self.sizes))  # largest first, so smaller graphs reuse its memory pool
        for bs in progress(sizes, len(sizes), "capturing decode graphs", logger):
            self._run(bs)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._run(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def stage(self, rows: DecodeRows) -> tuple[torch.Tensor, int]:
        """The decode rows in the next pinned host buffer, padded to their graph's size -> (buffer [max_bs, 4], bs)."""
        n = len(rows.reqs)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._turn ^= 1
        host = self._host[self._turn]
        values = host.numpy()
        values[:n, _REQ_IDX], values[:n, _COL] = rows.req_idx, rows.col
        values[:n, _POSITION], values[:n, _SLOT] = rows.position, rows.slot
        if n < bs:
            values[n:bs] = self._padding_row
        return host, bs

    def replay(self, host: torch.Tensor, n: int, bs: int) -> tuple[torch.Tensor, ...]:
        """Run the staged rows (host [>= bs, 4]) -> (logits [n, vocab], greedy ids [n], their logprobs [n], table
        rows [n]), all on the device."""
        self.static[:bs].copy_(host[:bs], non_blocking=True)
        self.graphs[bs].replay()
        logits, ids, logprobs = self.outputs[bs]
        return logits[:n], ids[:n], logprobs[:n], self.static[:n, _REQ_IDX]  # (the sampler scatters by row)
