"""Launches staged steps on the device without waiting for them.

A step's integer inputs go to the device in one copy from a pinned buffer; the ids of decode rows never leave the
device (the previous step scattered its samples into `last_token`, indexed by table row); image embeddings are
copied on a side stream; sampled ids and log-probs come back through a non-blocking copy into pinned memory that
`InflightStep.wait` reads once the step's CUDA event has fired. Pure decode steps replay a captured CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from language.cuda_graph import DecodeGraphs
from language.forward_batch import ForwardBatch
from language.kv_cache import KVCache
from language.request import Request
from language.sampler import SamplingBatch, sample, sample_greedy
from language.step_inputs import StagedStep

_ALIGN = 16  # int64 elements: 128 bytes


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


@dataclass
class InflightStep:
    """A launched step: which requests get which sampled row, and where the samples land on the host."""

    sampled: list[tuple[Request, int]]  # (request, row of ids/logprobs) for rows whose token is kept
    ids: torch.Tensor  # [num_seqs] int64, host (pinned on GPU)
    logprobs: torch.Tensor  # [num_seqs] float32, host
    event: torch.cuda.Event | None
    num_decode: int
    num_prefill_tokens: int

    def wait(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.ids.tolist(), self.logprobs.tolist()


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv: KVCache, device: torch.device, use_cuda_graph: bool, max_graph_batch: int
    ):
        self.model = model
        self.kv = kv
        self.device = device
        self.vocab_size = model.lm_head.weight.shape[0]
        self.eos_token_ids: tuple[int, ...] = ()  # set by the engine: min_new_tokens and the EOS length boost
        self.last_token = torch.zeros(kv.dummy_row + 1, dtype=torch.int64, device=device)  # [rows+1]
        self._meta = PinnedStaging(device)
        self._ids_out = PinnedStaging(device)
        self._lp_out = PinnedStaging(device, torch.float32)
        on_gpu = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if on_gpu else None
        self.graphs = DecodeGraphs(self, max_graph_batch) if use_cuda_graph and on_gpu else None

    @torch.inference_mode()
    def launch(self, staged: StagedStep) -> InflightStep:
        """Run the staged step and sample it, all queued on the device; returns at once."""
        nd = len(staged.decode.reqs)
        reqs = staged.decode.reqs + staged.prefill.reqs
        # The argmax fast path (and the decode graph's built-in greedy sample) only for plain greedy rows: penalties,
        # biases and masks change the logits, so any request with one sends the whole step through sample().
        all_greedy = all(r.params.greedy and not r.params.has_penalties and not r.params.has_logit_masks for r in reqs)
        if not staged.prefill.reqs and self.graphs is not None and self.graphs.can_run(nd):
            logits, ids, logprobs, req_idx = self.graphs.replay(staged.decode)  # greedy samples already stored
        else:
            batch = self._forward_batch(staged)
            logits, req_idx, ids = self.model(batch), batch.req_idx, None
        if ids is None or not all_greedy:
            if all_greedy:
                ids, logprobs = sample_greedy(logits)
            else:
                sb = SamplingBatch.build(reqs, self.vocab_size, self.device, self.eos_token_ids)
                ids, logprobs = sample(logits, sb)
            self.last_token[req_idx] = ids  # decode rows of the next step read their input ids from here
        host_ids, host_lps = self._ids_out.host(len(reqs)), self._lp_out.host(len(reqs))
        host_ids.copy_(ids, non_blocking=True)
        host_lps.copy_(logprobs, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        keep = [True] * nd + staged.prefill.samples.tolist()
        sampled = [(r, row) for row, (r, k) in enumerate(zip(reqs, keep, strict=True)) if k]
        return InflightStep(sampled, host_ids, host_lps, event, nd, staged.prefill.num_tokens)

    def _forward_batch(self, staged: StagedStep) -> ForwardBatch:
        """Pack the step's integers into one pinned buffer, copy it over in one go, and build the batch on views.
        Every array starts on a 128-byte boundary: Triton specialises kernels on pointer alignment, and unaligned
        views would compile new variants mid-load."""
        d, p = staged.decode, staged.prefill
        nd, n, b = len(d.reqs), staged.num_tokens, staged.num_seqs
        dims, npf, nm = p.positions.shape[0], len(p.reqs), p.mm_rows.shape[0]
        nt = n + p.table_slot.shape[0]  # table entries: each new token's, then the reused prefixes'
        sizes = [n, nt, nt, nt, dims * n, b, nd, npf, npf, npf, npf, b, nm]
        starts = np.cumsum([0] + [-(-size // _ALIGN) * _ALIGN for size in sizes])
        packed = self._meta.host(int(starts[-1]))
        host = packed.numpy()
        ids, slots, rows, cols, pos, req_idx, dec_lens, pf_idx, pf_lens, q_starts, q_lens, logits_idx, mm_rows = (
            host[start : start + size] for start, size in zip(starts, sizes, strict=False)
        )
        ids[:nd], ids[nd:] = 0, p.input_ids  # decode ids are filled in on the device
        slots[:nd], slots[nd:n], slots[n:] = d.slot, p.slot, p.table_slot
        rows[:nd], rows[nd:n], rows[n:] = d.req_idx, p.tok_req_idx, p.table_req_idx
        cols[:nd], cols[nd:n], cols[n:] = d.col, p.tok_col, p.table_col
        pos = pos.reshape(dims, n)
        pos[:, :nd], pos[:, nd:] = d.position, p.positions
        req_idx[:nd], req_idx[nd:] = d.req_idx, p.req_idx
        dec_lens[:], pf_idx[:], pf_lens[:] = d.col + 1, p.req_idx, p.seq_len
        q_starts[:], q_lens[:] = p.q_start, p.q_len
        logits_idx[:nd], logits_idx[nd:] = np.arange(nd), nd + p.q_start + p.q_len - 1
        mm_rows[:] = nd + p.mm_rows
        dev = self._meta.to_device(packed)
        views = [dev[start : start + size] for start, size in zip(starts, sizes, strict=False)]
        ids_d, slots_d, rows_d, cols_d, pos_d, req_idx_d, dec_lens_d, pf_idx_d, pf_lens_d = views[:9]
        q_starts_d, q_lens_d, logits_d, mm_rows_d = views[9:]
        if nd:
            ids_d[:nd] = self.last_token[req_idx_d[:nd]]
        self.kv.assign(rows_d, cols_d, slots_d)
        return ForwardBatch(
            input_ids=ids_d,
            positions=pos_d if dims == 1 else pos_d.view(dims, n),
            out_slots=slots_d[:n],
            num_decode=nd,
            req_idx=req_idx_d,
            decode_seq_lens=dec_lens_d,
            prefill_req_idx=pf_idx_d,
            prefill_seq_lens=pf_lens_d,
            q_starts=q_starts_d,
            q_lens=q_lens_d,
            max_q_len=int(p.q_len.max()) if npf else 0,
            kv=self.kv,
            max_decode_len=int(d.col.max()) + 1 if nd else None,
            logits_idx=None if npf == 0 else logits_d,
            mm_embeds=self._embeds_to_device(p.mm_embeds) if nm else None,
            mm_positions=mm_rows_d if nm else None,
        )

    def _embeds_to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[M, hidden] in the LM's dtype. On GPU the copy runs on a side stream, so the host returns while it
        proceeds beside the step in flight; the compute stream waits for it before the splice."""
        dtype = self.model.embed_tokens.weight.dtype  # the visual process may run in another dtype
        host = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self._copy_stream is None:
            return host.to(dtype)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            # Allocated from the copy stream's pool, so it never reuses memory the step in flight still reads;
            # record_stream keeps it from being reused before the compute stream is done with it.
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
        out.record_stream(compute)
        compute.wait_stream(self._copy_stream)
        return out.to(dtype)
