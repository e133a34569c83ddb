"""Launches staged steps on the device without waiting for them.

A step's integer inputs go to the device in one copy from a pinned buffer; the ids of decode rows never leave the
device (the previous step scattered its samples into `last_token`, indexed by table row); image embeddings are
uploaded on a side stream (`EmbedUpload`); sampled ids and log-probs come back through a non-blocking copy into
pinned memory that `InflightStep.wait` reads once the step's CUDA event has fired. Pure decode steps replay a
captured CUDA graph; prompt and mixed steps up to a size replay piecewise graphs (`PiecewiseGraphs`).

Log-probabilities beyond the chosen token's cost nothing unless asked: top-k alternatives are computed for a step
only when one of its rows asks (top_logprobs), and the head runs over prompt positions only for the chunks of
requests that asked for prompt_logprobs (their rows join the step's `logits_idx` after the sampled rows)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from language.cuda_graph import DecodeGraphs
from language.embed_upload import EmbedUpload
from language.forward_batch import ForwardBatch
from language.kv_cache import KVCache
from language.parallel import step_sync
from language.parallel.step_sync import StepChannel, StepMessage
from language.penalties import PenaltyTables
from language.piecewise_graphs import PiecewiseGraphs
from language.pinned_staging import PinnedStaging
from language.request import Request, TopLogprobs
from language.sampler import Samples, SamplingBatch, sample, sample_greedy, token_logprobs
from language.step_inputs import StagedStep

_ALIGN = 16  # int64 elements: 128 bytes


@dataclass
class HostSamples:
    """A step's samples on the host: per sampled row its id and log-probability (and alternatives when the step
    computed k > 0 of them), and the scores of the prompt positions that asked, in `InflightStep.scored` order."""

    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None  # [B][k]
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[float] | None = None  # [S]
    prompt_top_ids: list[list[int]] | None = None  # [S][kp]
    prompt_top_logprobs: list[list[float]] | None = None

    def top(self, row: int, k: int) -> TopLogprobs | None:
        """Row's k most likely (id, logprob), or None where it asked for none."""
        if k == 0 or self.top_ids is None:
            return None
        return list(zip(self.top_ids[row][:k], self.top_logprobs[row][:k], strict=True))

    def prompt_top(self, start: int, n: int, k: int) -> list[TopLogprobs]:
        ids, lps = self.prompt_top_ids, self.prompt_top_logprobs
        return [list(zip(ids[i][:k], lps[i][:k], strict=True)) for i in range(start, start + n)]


@dataclass
class InflightStep:
    """A launched step: which requests get which sampled row, and where the samples land on the host."""

    sampled: list[tuple[Request, int]]  # (request, row of ids/logprobs) for rows whose token is kept
    ids: torch.Tensor  # host int64 (pinned on GPU): ids [B], then top ids [B, k], then prompt top ids [S, kp]
    logprobs: torch.Tensor  # host float32: logprobs [B], top [B, k], prompt scores [S], prompt top [S, kp]
    event: torch.cuda.Event | None
    num_decode: int
    num_prefill_tokens: int
    scored: list[tuple[Request, int]] = field(default_factory=list)  # prompt_logprobs: (request, positions)
    widths: tuple[int, int, int, int] = (0, 0, 0, 0)  # B, k, S, kp
    constrained: bool = False  # some row was sampled under a grammar's token mask
    launched_at: float = 0.0  # perf_counter when its sampling was queued

    def done(self) -> bool:
        """The device has finished the step (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> HostSamples:
        if self.event is not None:
            self.event.synchronize()
        b, k, n, kp = self.widths
        ints, floats = self.ids.tolist(), self.logprobs.tolist()
        out = HostSamples(ints[:b], floats[:b])
        if k:
            out.top_ids = _rows(ints[b:], b, k)
            out.top_logprobs = _rows(floats[b:], b, k)
        if n:
            ints, floats = ints[b + b * k :], floats[b + b * k :]
            out.prompt_logprobs = floats[:n]
            if kp:
                out.prompt_top_ids = _rows(ints, n, kp)
                out.prompt_top_logprobs = _rows(floats[n:], n, kp)
        return out


@dataclass
class ForwardedStep:
    """A step whose forward is queued on the device and whose sampling is not yet."""

    staged: StagedStep
    reqs: list[Request]  # decode rows, then prefill chunks
    sampled: list[tuple[Request, int]]  # as InflightStep.sampled
    all_greedy: bool
    logits: torch.Tensor  # [b + S, vocab] on the device
    req_idx: torch.Tensor  # table row of each sampled row
    ids: torch.Tensor | None  # the decode graph's greedy samples, if it ran
    logprobs: torch.Tensor | None  # and their log-probabilities
    targets: torch.Tensor | None  # the prompt tokens that prompt_logprobs rows score


def _rows(flat: list, n: int, width: int) -> list[list]:
    return [flat[i * width : (i + 1) * width] for i in range(n)]


@dataclass(frozen=True)
class StepLayout:
    """The sizes of one step's packed integers (what a tensor-parallel rank needs besides the buffer itself)."""

    num_tokens: int  # n
    num_table: int  # table entries: each new token's, then the reused prefixes'
    dims: int  # position rows: 1, or 3 for M-RoPE
    num_seqs: int
    num_decode: int
    num_prefill: int
    num_mm: int  # image rows spliced in
    num_scored: int  # prompt positions scored for prompt_logprobs
    max_q_len: int
    max_decode_len: int  # -1: no decode rows
    num_key_ends: int = 0  # prefill rows with key ends (bidirectional image blocks), or 0

    def sizes(self) -> list[int]:
        n, nt, b, npf, ns = self.num_tokens, self.num_table, self.num_seqs, self.num_prefill, self.num_scored
        return [n, nt, nt, nt, self.dims * n, b, self.num_decode, npf, npf, npf, npf, b + ns, self.num_mm, ns,
                self.num_key_ends]  # fmt: skip

    def starts(self) -> np.ndarray:
        """Offsets of the arrays in the buffer, each on a 128-byte boundary, and the total at the end."""
        return np.cumsum([0] + [-(-size // _ALIGN) * _ALIGN for size in self.sizes()])

    def fields(self) -> list[int]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


_LAYOUT_FIELDS = len(dataclasses.fields(StepLayout))


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        device: torch.device,
        cuda_graph: bool,
        graph_max_batch_size: int,
        channel: StepChannel | None = None,
        piecewise_cuda_graph_max_tokens: int = 0,
    ):
        """channel: under tensor parallelism, where rank 0 sends each step and the other ranks receive it.
        piecewise_cuda_graph_max_tokens: eager steps of up to this many tokens replay piecewise graphs (on GPU, with
        CUDA graphs on); 0: none."""
        self.model = model
        self.kv = kv
        self.device = device
        self.channel = channel
        self.vocab_size = model.cfg.vocab_size  # the whole vocabulary: tensor-parallel logits are gathered
        self.eos_token_ids: tuple[int, ...] = ()  # set by the engine: min_new_tokens and the EOS length boost
        self.last_token = torch.zeros(kv.dummy_row + 1, dtype=torch.int64, device=device)  # [rows+1]
        self.penalties = PenaltyTables(self.vocab_size, device)  # rank 0 samples: only its tables fill
        self._meta = PinnedStaging(device)
        self._ids_out = PinnedStaging(device)
        self._lp_out = PinnedStaging(device, torch.float32)
        on_gpu = device.type == "cuda"
        self.embeds = EmbedUpload(device)
        self.graphs = DecodeGraphs(model, kv, self.last_token, graph_max_batch_size) if cuda_graph and on_gpu else None
        self.pieces = None
        # Under tensor parallelism too: every rank captures the pieces in the same order, and the followers replay
        # the graph rank 0 chose from the step's size (its row-parallel all-reduces are captured in them).
        if cuda_graph and on_gpu and piecewise_cuda_graph_max_tokens > 0:
            self.pieces = PiecewiseGraphs(model, kv, device, piecewise_cuda_graph_max_tokens)

    def replays_pieces(self, num_tokens: int) -> bool:
        """A prompt or mixed step of this many tokens replays piecewise graphs: its launch takes little host time.
        (A Qwen3-VL step with images runs eagerly all the same: its DeepStack adds work between the layers.)"""
        return self.pieces is not None and self.pieces.fits(num_tokens)

    def launch(self, staged: StagedStep) -> InflightStep:
        """Run the staged step and sample it, all queued on the device; returns at once."""
        return self.sample(self.forward(staged))

    @torch.inference_mode()
    def forward(self, staged: StagedStep) -> ForwardedStep:
        """The model's part of a step, queued on the device: its logits are kept for `sample`. A step with grammar
        constraints samples only once their token masks are filled on the host, while the device runs this."""
        nd = len(staged.decode.reqs)
        reqs = staged.decode.reqs + staged.prefill.reqs
        # The argmax fast path (and the decode graph's built-in greedy sample) only for plain greedy rows: penalties,
        # biases and masks change the logits, so any request with one sends the whole step through sample().
        all_greedy = all(r.params.greedy and not r.params.has_penalties and not r.params.has_logit_masks for r in reqs)
        ids = logprobs = targets = None
        if not staged.prefill.reqs and self.graphs is not None and self.graphs.can_run(nd):
            host, bs = self.graphs.stage(staged.decode)
            if self.channel is not None:
                self.channel.send(step_sync.GRAPH, [nd, bs, all_greedy], host[:bs].view(-1))
            logits, ids, logprobs, req_idx = self.graphs.replay(host, nd, bs)  # greedy samples already stored
        else:
            packed, layout = self._pack(staged)
            if self.channel is not None:
                self.channel.send(step_sync.EAGER, layout.fields() + [all_greedy], packed)
            embeds = None
            if layout.num_mm:
                embeds = self.embeds.to_device(staged.prefill.mm_embeds, self.model.embed_tokens.weight.dtype)
                if self.channel is not None:
                    self.channel.share(embeds)
            batch, targets = self._batch(packed, layout, embeds)
            logits, req_idx = self._forward(batch), batch.req_idx  # [b + S, vocab]
        keep = [True] * nd + staged.prefill.samples.tolist()
        sampled = [(r, row) for row, (r, kept) in enumerate(zip(reqs, keep, strict=True)) if kept]
        return ForwardedStep(staged, reqs, sampled, all_greedy, logits, req_idx, ids, logprobs, targets)

    @torch.inference_mode()
    def sample(self, fwd: ForwardedStep, token_mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> InflightStep:
        """Sample a forwarded step (token_mask: (rows, bitmask) on the device for its constrained rows) and start
        copying the samples back; returns at once."""
        staged, reqs, logits, ids = fwd.staged, fwd.reqs, fwd.logits, fwd.ids
        nd, b, all_greedy = len(staged.decode.reqs), len(fwd.reqs), fwd.all_greedy
        k = max(r.params.top_logprobs for r in reqs)
        if ids is None or not all_greedy:
            if all_greedy:
                samples = sample_greedy(logits[:b], k)
            else:
                sb = SamplingBatch.build(reqs, self.vocab_size, self.device, self.eos_token_ids, self.penalties)
                sb.token_mask = token_mask
                samples = sample(logits[:b], sb)
                if self.channel is not None:  # the other ranks' next decode rows read them from last_token
                    self.channel.share(samples.ids)
            self.last_token[fwd.req_idx] = samples.ids  # decode rows of the next step read their input ids from here
        elif k:  # the graph sampled greedily: only the alternatives are left to compute
            samples = token_logprobs(logits, ids, k)
        else:
            samples = Samples(ids, fwd.logprobs)
        scored = staged.prefill.scored
        kp = max((r.params.prompt_logprobs for r, _ in scored), default=0)
        prompt = token_logprobs(logits[b:], fwd.targets, kp) if scored else None
        ints = [samples.ids, samples.top_ids] + ([prompt.top_ids] if prompt else [])
        floats = [samples.logprobs, samples.top_logprobs] + ([prompt.logprobs, prompt.top_logprobs] if prompt else [])
        host_ids, host_lps = _copy_out(self._ids_out, ints), _copy_out(self._lp_out, floats)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        widths = (b, k, len(staged.prefill.score_rows), kp)
        return InflightStep(fwd.sampled, host_ids, host_lps, event, nd, staged.prefill.num_tokens, scored, widths,
                            launched_at=time.perf_counter())  # fmt: skip

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.pieces is not None and self.pieces.can_run(batch):
            return self.pieces.forward(batch)
        return self.model(batch)

    @torch.inference_mode()
    def follow(self, msg: StepMessage) -> None:
        """A tensor-parallel rank other than 0: run the step rank 0 sent, as rank 0 runs it (same collectives in the
        same order), and keep `last_token` equal to rank 0's. Log-probabilities are rank 0's business."""
        if msg.kind == step_sync.GRAPH:
            n, bs, all_greedy = msg.fields[:3]
            logits, ids, _, req_idx = self.graphs.replay(msg.payload.view(bs, -1), n, bs)
            num_seqs = n
        else:
            layout = StepLayout(*msg.fields[:_LAYOUT_FIELDS])
            all_greedy, num_seqs = msg.fields[_LAYOUT_FIELDS], layout.num_seqs
            embeds = None
            if layout.num_mm:
                dtype = self.model.embed_tokens.weight.dtype
                shape = (layout.num_mm, self.model.cfg.hidden_size)
                embeds = self.channel.share(torch.empty(shape, dtype=dtype, device=self.device))
            batch, _ = self._batch(msg.payload, layout, embeds)
            logits, req_idx, ids = self._forward(batch), batch.req_idx, None
            if all_greedy:
                ids = sample_greedy(logits[:num_seqs], 0).ids
        if not all_greedy:
            ids = self.channel.share(torch.empty(num_seqs, dtype=torch.int64, device=self.device))
        self.last_token[req_idx] = ids

    def _pack(self, staged: StagedStep) -> tuple[torch.Tensor, StepLayout]:
        """The step's integers in one pinned host buffer. Every array starts on a 128-byte boundary: Triton
        specialises kernels on pointer alignment, and unaligned views would compile new variants mid-load."""
        d, p = staged.decode, staged.prefill
        nd, n, b = len(d.reqs), staged.num_tokens, staged.num_seqs
        npf = len(p.reqs)
        layout = StepLayout(
            num_tokens=n,
            num_table=n + p.table_slot.shape[0],
            dims=p.positions.shape[0],
            num_seqs=b,
            num_decode=nd,
            num_prefill=npf,
            num_mm=p.mm_rows.shape[0],
            num_scored=p.score_rows.shape[0],
            max_q_len=int(p.q_len.max()) if npf else 0,
            max_decode_len=int(d.col.max()) + 1 if nd else -1,
            num_key_ends=p.key_ends.shape[0],
        )
        sizes, starts = layout.sizes(), layout.starts()
        packed = self._meta.host(int(starts[-1]))
        host = packed.numpy()
        arrays = [host[start : start + size] for start, size in zip(starts, sizes, strict=False)]
        ids, slots, rows, cols, pos, req_idx, dec_lens, pf_idx, pf_lens, q_starts, q_lens = arrays[:11]
        logits_idx, mm_rows, scored, key_ends = arrays[11:]
        ids[:nd], ids[nd:] = 0, p.input_ids  # decode ids are filled in on the device
        slots[:nd], slots[nd:n], slots[n:] = d.slot, p.slot, p.table_slot
        rows[:nd], rows[nd:n], rows[n:] = d.req_idx, p.tok_req_idx, p.table_req_idx
        cols[:nd], cols[nd:n], cols[n:] = d.col, p.tok_col, p.table_col
        pos = pos.reshape(layout.dims, n)
        pos[:, :nd], pos[:, nd:] = d.position, p.positions
        req_idx[:nd], req_idx[nd:] = d.req_idx, p.req_idx
        dec_lens[:], pf_idx[:], pf_lens[:] = d.col + 1, p.req_idx, p.seq_len
        q_starts[:], q_lens[:] = p.q_start, p.q_len
        logits_idx[:nd], logits_idx[nd:b] = np.arange(nd), nd + p.q_start + p.q_len - 1
        logits_idx[b:], scored[:] = nd + p.score_rows, p.score_targets  # after the sampled rows
        mm_rows[:] = nd + p.mm_rows
        key_ends[:] = p.key_ends
        return packed, layout

    def _batch(
        self, packed: torch.Tensor, layout: StepLayout, embeds: torch.Tensor | None
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """Copy the packed integers over in one go and build the batch on views of them (and the prompt tokens
        that prompt_logprobs rows score, [S] on the device)."""
        sizes, starts = layout.sizes(), layout.starts()
        nd, n, dims = layout.num_decode, layout.num_tokens, layout.dims
        dev = self._meta.to_device(packed)
        views = [dev[start : start + size] for start, size in zip(starts, sizes, strict=False)]
        ids_d, slots_d, rows_d, cols_d, pos_d, req_idx_d, dec_lens_d, pf_idx_d, pf_lens_d = views[:9]
        q_starts_d, q_lens_d, logits_d, mm_rows_d, scored_d, key_ends_d = views[9:]
        if nd:
            ids_d[:nd] = self.last_token[req_idx_d[:nd]]
        self.kv.assign(rows_d, cols_d, slots_d)
        batch = ForwardBatch(
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
            max_q_len=layout.max_q_len,
            kv=self.kv,
            max_decode_len=layout.max_decode_len if nd else None,
            logits_idx=None if layout.num_prefill == 0 else logits_d,
            mm_embeds=embeds,
            mm_positions=mm_rows_d if layout.num_mm else None,
            prefill_key_ends=key_ends_d if layout.num_key_ends else None,
        )
        return batch, scored_d


def _copy_out(staging: PinnedStaging, parts: list[torch.Tensor | None]) -> torch.Tensor:
    """Device tensors (None skipped) -> one host buffer, one after another, flattened, without waiting."""
    parts = [t for t in parts if t is not None]
    host = staging.host(sum(t.numel() for t in parts))
    start = 0
    for t in parts:
        host[start : start + t.numel()].view(t.shape).copy_(t, non_blocking=True)
        start += t.numel()
    return host
