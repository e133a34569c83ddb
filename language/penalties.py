"""Repetition, frequency and presence penalties from token statistics kept on the device.

Each request with penalties owns a row of two [rows, vocab] tables: which ids its prompt holds, and how often each id
came out (the prompt's ids too with LightLLM's `input_penalty`). The row is filled from the prompt once, at the
request's first sample, and every step then adds its sampled ids on the device, in stream order. So the host never
rebuilds a token history (batch x length ids a step), and the next step may launch before this one's tokens are read
back. Row 0 stays zero: the row of each request without penalties in a batch that has some.

A row is 5 bytes per vocabulary id (760 KB for a 152k vocabulary); the tables grow by doubling as requests with
penalties arrive and keep their size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from language import kernels
from language.request import Request


@dataclass(frozen=True)
class Penalties:
    """One step's penalty rows and values (all on the logits' device)."""

    rows: torch.Tensor  # int64 [B]: each batch row's table row (0: a request without penalties)
    counted: torch.Tensor  # int64 [P]: the batch rows whose samples are counted (those with penalties)
    counted_rows: torch.Tensor  # int64 [P]: their table rows
    repetition: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]


class PenaltyTables:
    """The engine's per-request penalty tables (the module docstring), and which request holds which row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.in_prompt = torch.zeros((1, vocab_size), dtype=torch.bool, device=device)  # [rows, V]
        self.counts = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)  # [rows, V]
        self._free: list[int] = []
        # id(request) -> (the request, its table row): holding the request keeps its id from being reused
        self._held: dict[int, tuple[Request, int]] = {}

    def batch(self, reqs: list[Request]) -> Penalties:
        """The penalties of a step's rows; a request with penalties gets its table row on its first sample. A request
        already finished (its row still runs in a step launched before the host knew) keeps none: its sample is
        ignored."""
        rows = [self._row(r) if r.params.has_penalties and not r.finished else 0 for r in reqs]
        counted = [i for i, row in enumerate(rows) if row]
        b, n = len(rows), len(counted)
        # one copy for the ints, one for the floats
        ints = torch.tensor(rows + counted + [rows[i] for i in counted], dtype=torch.int64)  # [B + 2P]
        ints = ints.to(self.device, non_blocking=True)
        ps = [r.params for r in reqs]
        values = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in ps]
        floats = torch.tensor(values, dtype=torch.float32).T.contiguous().to(self.device, non_blocking=True)  # [3, B]
        return Penalties(ints[:b], ints[b : b + n], ints[b + n :], floats[0], floats[1], floats[2])

    @property
    def rows_held(self) -> int:
        """Requests holding a row (each until it finishes)."""
        return len(self._held)

    def count(self, p: Penalties, ids: torch.Tensor) -> None:
        """Add a step's samples ([B] on the device) to their requests' counts."""
        if p.counted.numel():
            sampled = ids.index_select(0, p.counted)
            ones = torch.ones(sampled.shape, dtype=torch.float32, device=self.device)
            self.counts.index_put_((p.counted_rows, sampled), ones, accumulate=True)

    def release(self, req: Request) -> None:
        """A finished request's row goes back (steps already launched may still add to it: a row is cleared when it
        is next taken, behind them on the stream)."""
        held = self._held.pop(id(req), None)
        if held is not None:
            self._free.append(held[1])

    def _row(self, r: Request) -> int:
        if (held := self._held.get(id(r))) is not None:
            return held[1]
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._held[id(r)] = (r, row)
        prompt = torch.tensor(r.prompt_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.in_prompt[row] = False
        self.in_prompt[row, prompt] = True
        self.counts[row] = 0
        if r.params.input_penalty:  # LightLLM: frequency and presence count the prompt's ids as well
            self.counts[row].index_add_(0, prompt, torch.ones(prompt.shape, device=self.device))
        if r.output_ids:  # tables built for one batch (no engine's): the outputs collected so far
            out = torch.tensor(r.output_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.counts[row].index_add_(0, out, torch.ones(out.shape, device=self.device))
        return row

    def _grow(self) -> None:
        """Double the rows (at least 8 new), copying the old ones in stream order: after the steps that wrote them."""
        old = self.counts.shape[0]
        new = old + max(old, 8)
        in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
        in_prompt[:old], counts[:old] = self.in_prompt, self.counts
        self.in_prompt, self.counts = in_prompt, counts
        self._free.extend(range(new - 1, old - 1, -1))  # popped lowest first


def apply_penalties(logits: torch.Tensor, p: Penalties, tables: PenaltyTables) -> torch.Tensor:
    """logits [B, V] float32 -> penalised, out of place: HF's repetition penalty over the prompt's and the output's
    ids (positive logits divided, negative multiplied), then OpenAI's frequency (per occurrence) and presence (once)
    penalties over the counted ids (`kernels.penalize`: one pass on the GPU)."""
    return kernels.penalize(logits, p.rows, tables.counts, tables.in_prompt, p.repetition, p.frequency, p.presence)
