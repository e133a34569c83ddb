"""Batched sampling: penalties (language/penalties.py), logit bias, allowed-token and min-new-tokens masks, the EOS
length boost, grammar token masks (structured output), then each row's draw (language/draw.py: temperature, min-p,
top-k, top-p, per-request seeds) or greedy argmax — all as tensor ops over the whole batch.

Log-probabilities (the chosen token's, and the top-k alternatives OpenAI's top_logprobs asks for) are the log-softmax
of the logits the token was chosen from, after penalties, logit bias and masks (grammar masks too) but before the
draw's temperature and cuts: for a request without penalties, bias or masks that is the log-softmax of the model's
raw logits, vLLM's default (`logprobs_mode` raw_logprobs). Top-k alternatives are computed only when some row of the
step asks for them, once for the whole batch (k = the largest any row asks for); each row then reads its own first
k."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from language import kernels
from language.draw import DrawPlan, draw, plan_draws
from language.penalties import Penalties, PenaltyTables, apply_penalties
from language.request import Request

# The EOS boost (HF's exponential_decay_length_penalty) grows without bound with the length; capped, the boosted
# logit stays far inside float32 (|logit| * 1e30 < 3.4e38 for any logit a model gives), so nothing becomes inf/NaN.
_MAX_BOOST = 1e30
_MAX_LOG_BOOST = math.log(_MAX_BOOST)


@dataclass
class SamplingBatch:
    """A step's sampling, per row, on the logits' device."""

    draws: DrawPlan  # the sampled rows, by how they draw (language/draw.py)
    penalties: Penalties | None
    penalty_tables: PenaltyTables | None  # where the penalties' rows live; sampling counts its samples there
    processors: LogitProcessors | None = None
    top_logprobs: int = 0  # alternatives to return: the most any row asks for (0: none computed)
    # Structured output: (rows [R] int64, bitmask [R, ceil(V / 32)] int32) of the rows a grammar constrains
    token_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        reqs: list[Request],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        penalty_tables: PenaltyTables | None = None,
    ) -> SamplingBatch:
        """penalty_tables: the engine's, which keep each request's counts from step to step; None: tables for this
        batch alone, filled from each request's prompt and collected outputs."""
        ps = [r.params for r in reqs]
        penalties = None
        if any(p.has_penalties for p in ps):
            penalty_tables = penalty_tables or PenaltyTables(vocab_size, device)
            penalties = penalty_tables.batch(reqs)
        return cls(
            draws=plan_draws(reqs, [_sampled_before(r) for r in reqs], vocab_size, device),
            penalties=penalties,
            penalty_tables=penalty_tables,
            processors=(
                LogitProcessors.build(reqs, eos_token_ids, vocab_size, device)
                if any(p.has_logit_processors for p in ps)
                else None
            ),
            top_logprobs=max(p.top_logprobs for p in ps),
        )


@dataclass(frozen=True)
class _FixedEdits:
    """A request's logit edits that no step changes, built once (CPU tensors)."""

    bias_ids: torch.Tensor  # int64 [N]
    bias: torch.Tensor  # float32 [N]
    allowed_ids: torch.Tensor | None  # int64 [A], each id once; None: no restriction
    banned_ids: torch.Tensor  # int64 [M]: stop ids in the vocabulary (and EOS unless ignore_eos), before min_new_tokens


def _fixed_edits(r: Request, eos_token_ids: tuple[int, ...], vocab_size: int) -> _FixedEdits:
    if r.logit_edits is None:
        p = r.params
        banned = p.min_tokens_bans(eos_token_ids)
        allowed = p.allowed_token_ids
        r.logit_edits = _FixedEdits(
            torch.tensor([token for token, _ in p.logit_bias], dtype=torch.int64),
            torch.tensor([float(b) for _, b in p.logit_bias], dtype=torch.float32),
            None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.int64),
            torch.tensor(sorted(t for t in banned if t < vocab_size), dtype=torch.int64),  # others never come
        )
    return r.logit_edits


def _sampled_before(r: Request) -> int:
    """Output tokens that come before the one this step samples for r. Staging counted this step's sample in
    `num_sampled` already, and with the overlapped engine `output_ids` may lag a step behind, so it is not used."""
    return max(r.num_sampled - 1, 0)


@dataclass
class LogitProcessors:
    """Sparse per-row edits of the logits, as index tensors (no loop over the vocabulary): biases added at (row,
    id), rows restricted to an allowed set, (row, id) pairs banned (EOS and stop ids before min_new_tokens), and
    EOS boosts (HF's exponential_decay_length_penalty)."""

    bias_rows: torch.Tensor  # int64 [N]
    bias_ids: torch.Tensor  # int64 [N]
    bias: torch.Tensor  # float32 [N]
    restricted: torch.Tensor | None  # bool [B]: rows with allowed_token_ids; None when no row has them
    allowed_rows: torch.Tensor  # int64 [A]
    allowed_ids: torch.Tensor  # int64 [A]
    ban_rows: torch.Tensor  # int64 [M]
    ban_ids: torch.Tensor  # int64 [M]
    boost_rows: torch.Tensor  # int64 [E]
    boost_ids: torch.Tensor  # int64 [E]
    boost: torch.Tensor  # float32 [E]: decay_factor ** (generated - start) - 1

    @classmethod
    def build(
        cls, reqs: list[Request], eos_token_ids: tuple[int, ...], vocab_size: int, device: torch.device
    ) -> LogitProcessors:
        """Each row's fixed edits come as tensors built on the request's first step (`_fixed_edits`): a request's
        allowed ids or logit bias may cover the whole vocabulary, and a loop over them every step would hold up the
        engine's loop, which every request waits for."""
        bias, allowed, ban = [], [], []  # (row, ids[, values]) of each row that has them
        boost_r, boost_i, boost_v = [], [], []
        restricted = [False] * len(reqs)
        for row, r in enumerate(reqs):
            p = r.params
            if not p.has_logit_processors:
                continue
            fixed = _fixed_edits(r, eos_token_ids, vocab_size)
            if fixed.bias_ids.numel():
                bias.append((row, fixed.bias_ids, fixed.bias))
            if fixed.allowed_ids is not None:
                restricted[row] = True
                allowed.append((row, fixed.allowed_ids))
            before = _sampled_before(r)
            if before < p.min_new_tokens and fixed.banned_ids.numel():
                ban.append((row, fixed.banned_ids))
            decay = p.exponential_decay_length_penalty
            if decay is not None and before > decay[0] and eos_token_ids:
                factor = _eos_boost(float(decay[1]), before - decay[0])
                boost_r.extend([row] * len(eos_token_ids))
                boost_i.extend(eos_token_ids)
                boost_v.extend([factor] * len(eos_token_ids))

        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        def rows(parts) -> torch.Tensor:  # int64 [the parts' lengths summed]: each part's row, repeated
            if not parts:
                return t([])
            repeated = [torch.full((part[1].numel(),), part[0], dtype=torch.int64) for part in parts]
            return torch.cat(repeated).to(device, non_blocking=True)

        def joined(parts, i: int, dtype=torch.int64) -> torch.Tensor:
            return torch.cat([part[i] for part in parts]).to(device, non_blocking=True) if parts else t([], dtype)

        return cls(
            rows(bias), joined(bias, 1), joined(bias, 2, torch.float32),
            t(restricted, torch.bool) if any(restricted) else None, rows(allowed), joined(allowed, 1),
            rows(ban), joined(ban, 1), t(boost_r), t(boost_i), t(boost_v, torch.float32),
        )  # fmt: skip

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        if self.bias.numel():
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias, accumulate=True)
        if self.boost.numel():  # HF: scores[eos] += |scores[eos]| * (factor ** k - 1)
            eos = logits[self.boost_rows, self.boost_ids]
            boost = (eos.abs() * self.boost).clamp_(max=_MAX_BOOST)
            logits.index_put_((self.boost_rows, self.boost_ids), boost, accumulate=True)
        if self.restricted is not None:
            allowed = torch.zeros_like(logits, dtype=torch.bool)
            allowed[self.allowed_rows, self.allowed_ids] = True
            logits.masked_fill_(self.restricted[:, None] & ~allowed, float("-inf"))
        if self.ban_ids.numel():
            logits[self.ban_rows, self.ban_ids] = float("-inf")
        return logits


def _eos_boost(decay_factor: float, steps: int) -> float:
    """decay_factor ** steps - 1, capped at _MAX_BOOST (computed in log space: the power alone overflows a float)."""
    return math.exp(min(steps * math.log(decay_factor), _MAX_LOG_BOOST)) - 1.0


class Samples(NamedTuple):
    """One step's samples: ids [B] int64 and their log-probabilities [B] float32; when some row asks for
    alternatives, the k most likely ids of every row [B, k] int64 and their log-probabilities [B, k] float32."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int = 0) -> Samples:
    """log_softmax(logits)[row, ids[row]] and, if k > 0, the k largest entries of each row's log-softmax, without a
    [B, V] log-softmax table: the logits (or their top-k) minus their logsumexp, in float32. logits: [B, V] in any
    float dtype, ids: [B]."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # [B]
    chosen = logits.gather(1, ids[:, None]).squeeze(1) - lse
    if k == 0:
        return Samples(ids, chosen)
    values, top_ids = logits.topk(k, dim=-1)  # [B, k], largest first
    return Samples(ids, chosen, top_ids, values - lse[:, None])


def sample_greedy(logits: torch.Tensor, top_logprobs: int = 0) -> Samples:
    """The fast path for a batch that is all greedy with no penalties: argmax and its log-probability (and the
    top_logprobs most likely ids), with no sort and no full log-softmax table. logits: [B, V] in the LM head's
    dtype; without alternatives, one kernel reads them as they are (on CUDA), with no float32 copy."""
    if top_logprobs == 0:
        return Samples(*kernels.greedy_sample(logits))
    logits = logits.float()
    return token_logprobs(logits, logits.argmax(dim=-1), top_logprobs)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> Samples:
    """logits: [B, V] (any float dtype; sampled in float32) -> next token ids [B] int64, their log-probabilities [B]
    float32 (and sb.top_logprobs alternatives per row, when some row asks)."""
    logits = logits.float()
    if sb.penalties is not None:
        logits = apply_penalties(logits, sb.penalties, sb.penalty_tables)
    if sb.processors is not None:
        logits = sb.processors.apply(logits)
    if sb.token_mask is not None:
        logits = apply_token_bitmask(logits, *sb.token_mask)
    next_ids = draw(logits, sb.draws)
    if sb.penalties is not None:
        sb.penalty_tables.count(sb.penalties, next_ids)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]: one kernel (logsumexp takes five and a [B, V] temporary)
    chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
    if not sb.top_logprobs:
        return Samples(next_ids, chosen)
    top_values, top_ids = logprobs.topk(sb.top_logprobs, dim=-1)  # [B, k]
    return Samples(next_ids, chosen, top_ids, top_values)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The logits with row rows[i] keeping only the ids whose bit is set in bitmask[i] (id 32 * w + j is bit j of
    word w, xgrammar's layout), the others -inf; other rows unchanged. Out of place. logits [B, V] float32, rows [R]
    int64, bitmask [R, W] int32 with 32 * W >= V."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()  # [R, V]
    masked = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
