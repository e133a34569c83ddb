"""Turns the scheduled requests into ForwardBatches, runs the model, and replays captured CUDA graphs for decode."""

from __future__ import annotations

import torch

from language.cuda_graph import DecodeGraphs
from language.forward_batch import ForwardBatch
from language.kv_cache import KVCache
from language.request import Request


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv: KVCache, device: torch.device, use_cuda_graph: bool, max_graph_batch: int
    ):
        self.model = model
        self.kv = kv
        self.device = device
        self.graphs = DecodeGraphs(self, max_graph_batch) if use_cuda_graph and device.type == "cuda" else None

    @torch.inference_mode()
    def prefill(self, reqs: list[Request]) -> torch.Tensor:
        """Allocate rows and slots for the prompts of newly admitted requests and run them. -> logits [B, vocab]"""
        return self.model(self.build_prefill(reqs))

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """Store each running request's last sampled token and run one step. -> logits [B, vocab]"""
        batch = self.build_decode(reqs)
        if self.graphs is not None and self.graphs.can_run(len(reqs)):
            return self.graphs.replay(batch)
        return self.model(batch)

    def build_prefill(self, reqs: list[Request]) -> ForwardBatch:
        dev, kv = self.device, self.kv
        lens = [r.prompt_len for r in reqs]
        for r in reqs:
            r.req_idx = kv.allocate_row()
        slots = kv.slots.allocate(sum(lens))  # [num_tokens]
        q_lens = torch.tensor(lens, dtype=torch.int64)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        rows = torch.repeat_interleave(torch.tensor([r.req_idx for r in reqs]), q_lens)  # [num_tokens]
        cols = torch.arange(int(q_lens.sum())) - torch.repeat_interleave(q_starts, q_lens)  # position in its sequence
        kv.assign(rows, cols, slots)
        input_ids = torch.tensor([t for r in reqs for t in r.prompt_ids], dtype=torch.int64)
        mm_embeds, mm_positions = self._mm_inputs(reqs, q_starts.tolist())
        return ForwardBatch(
            is_prefill=True,
            input_ids=input_ids.to(dev, non_blocking=True),
            positions=self._prefill_positions(reqs, cols).to(dev, non_blocking=True),
            out_slots=slots.to(dev, non_blocking=True),
            req_idx=_i32([r.req_idx for r in reqs], dev),
            seq_lens=_i32(lens, dev),
            q_starts=q_starts.to(dev, torch.int32, non_blocking=True),
            q_lens=q_lens.to(dev, torch.int32, non_blocking=True),
            logits_idx=(q_starts + q_lens - 1).to(dev, non_blocking=True),
            max_q_len=max(lens),
            kv=kv,
            mm_embeds=mm_embeds,
            mm_positions=mm_positions,
        )

    def build_decode(self, reqs: list[Request]) -> ForwardBatch:
        dev, kv = self.device, self.kv
        n = len(reqs)
        slots = kv.slots.allocate(n)  # [B]
        cols = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64)  # table column of the stored token
        rows = torch.tensor([r.req_idx for r in reqs], dtype=torch.int64)
        kv.assign(rows, cols, slots)
        if self.model.position_dims == 1:
            positions = cols
        else:
            positions = (cols + torch.tensor([r.position_delta for r in reqs]))[None, :].expand(3, n)
        return ForwardBatch(
            is_prefill=False,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.contiguous().to(dev, non_blocking=True),
            out_slots=slots.to(dev, non_blocking=True),
            req_idx=rows.to(dev, torch.int32, non_blocking=True),
            seq_lens=(cols + 1).to(dev, torch.int32, non_blocking=True),
            q_starts=torch.arange(n, dtype=torch.int32).to(dev, non_blocking=True),
            q_lens=torch.ones(n, dtype=torch.int32).to(dev, non_blocking=True),
            logits_idx=torch.arange(n, dtype=torch.int64).to(dev, non_blocking=True),
            max_q_len=1,
            kv=kv,
        )

    def _prefill_positions(self, reqs: list[Request], cols: torch.Tensor) -> torch.Tensor:
        if self.model.position_dims == 1:
            return cols
        parts = [
            r.positions if r.positions is not None else torch.arange(r.prompt_len)[None].expand(3, -1) for r in reqs
        ]
        return torch.cat(parts, dim=1)  # [3, num_tokens]

    def _mm_inputs(self, reqs: list[Request], q_starts: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        items = [(start + item.offset, item) for r, start in zip(reqs, q_starts, strict=True) for item in r.mm_items]
        if not items:
            return None, None
        dtype = self.model.embed_tokens.weight.dtype  # the visual process may run in another dtype
        embeds = torch.cat([item.embeds for _, item in items]).to(self.device, dtype, non_blocking=True)  # [M, hidden]
        positions = torch.cat([torch.arange(s, s + item.num_tokens) for s, item in items])  # [M]
        return embeds, positions.to(self.device, non_blocking=True)
