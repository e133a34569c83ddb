"""Drawing each sampled row's token: temperature, top-k, top-p, min-p and per-request seeds.

Rows go one of three ways, by their own parameters only, so a seeded request draws the same tokens whatever batch
it runs in:
- narrow: a top-k of at most NARROW_K (HF's default 50, Qwen's recommended 20) draws from the row's NARROW_K largest
  logits: one `topk` over the vocabulary, then the min-p, top-k and top-p cuts (vLLM's order) and the draw over those
  few columns;
- nucleus: no top-k (the common OpenAI request: temperature and top-p) draws over the whole vocabulary without
  sorting it (kernels.nucleus_draw: rejection against the min-p and top-p cuts);
- wide top-k: a top-k above NARROW_K and below the vocabulary's size draws as the narrow rows do, from the largest
  logits up to the group's largest top-k.

The draw is an exponential race: argmax(p / E) with E ~ Exp(1) per column draws from p without a cumulative-sum
search; a seeded row's E comes from a counter-based hash of (seed, step, token id), and so does every nucleus row's
(an unseeded one with a fresh seed each step)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from language import kernels
from language.kernels.sampling_reference import seeded_uniform
from language.request import Request

NARROW_K = 1024
_SEED_BITS = 62  # an unseeded row's fresh seed per step


@dataclass(frozen=True)
class DrawRows:
    """The sampled rows that go one way, and their parameters, on the logits' device."""

    rows: torch.Tensor  # int64 [R]: their rows of the batch
    top_k: torch.Tensor  # int64 [R] (the vocabulary's size where off)
    seeded: torch.Tensor  # bool [R]
    seed: torch.Tensor  # int64 [R]: the request's, or a fresh one this step
    step: torch.Tensor  # int64 [R]: output tokens sampled before this one (varies the seeded noise per step)
    temperature: torch.Tensor  # float32 [R]
    top_p: torch.Tensor  # float32 [R]
    log_min_p: torch.Tensor  # float32 [R]: log(min_p), -inf where off
    any_top: bool  # some row cuts by top-k or top-p
    any_min_p: bool
    any_seeded: bool

    @classmethod
    def build(
        cls, rows: list[int], reqs: list[Request], steps: list[int], vocab_size: int, device: torch.device
    ) -> DrawRows | None:
        if not rows:
            return None
        ps = [reqs[i].params for i in rows]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
        fresh = torch.randint(0, 2**_SEED_BITS, (len(rows),)).tolist()
        seeds = [p.seed if p.seed is not None else f for p, f in zip(ps, fresh, strict=True)]
        ints = torch.tensor(
            [rows, top_k, [p.seed is not None for p in ps], seeds, [steps[i] for i in rows]], dtype=torch.int64
        ).to(device, non_blocking=True)  # [5, R]: one copy
        log_min_p = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps]
        floats = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps], log_min_p], dtype=torch.float32)
        floats = floats.to(device, non_blocking=True)  # [3, R]
        return cls(
            ints[0], ints[1], ints[2].bool(), ints[3], ints[4], floats[0], floats[1], floats[2],
            any_top=any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in ps),
            any_min_p=any(p.min_p > 0 for p in ps),
            any_seeded=any(p.seed is not None for p in ps),
        )  # fmt: skip


@dataclass(frozen=True)
class DrawPlan:
    """A step's sampled (not greedy) rows by the way they draw; None where no row goes that way."""

    narrow: DrawRows | None = None
    nucleus: DrawRows | None = None
    wide_top_k: DrawRows | None = None
    wide_columns: int = 0  # the largest top-k of the wide_top_k rows

    @property
    def empty(self) -> bool:
        return self.narrow is None and self.nucleus is None and self.wide_top_k is None


def plan_draws(reqs: list[Request], steps: list[int], vocab_size: int, device: torch.device) -> DrawPlan:
    narrow_limit = min(NARROW_K, vocab_size)
    narrow, nucleus, wide = [], [], []
    for i, r in enumerate(reqs):
        p = r.params
        if p.greedy:
            continue
        if 0 < p.top_k <= narrow_limit or vocab_size <= narrow_limit:
            narrow.append(i)
        elif p.top_k <= 0 or p.top_k >= vocab_size:
            nucleus.append(i)
        else:
            wide.append(i)
    groups = (DrawRows.build(group, reqs, steps, vocab_size, device) for group in (narrow, nucleus, wide))
    return DrawPlan(*groups, wide_columns=max((reqs[i].params.top_k for i in wide), default=0))


def draw(logits: torch.Tensor, plan: DrawPlan) -> torch.Tensor:
    """logits: [B, V] float32 (penalised, biased and masked) -> [B] int64: greedy rows' argmax, the others drawn."""
    batch = logits.shape[0]
    ways = (
        (plan.narrow, functools.partial(_draw_top, columns=NARROW_K)),
        (plan.nucleus, _draw_nucleus),
        (plan.wide_top_k, functools.partial(_draw_top, columns=plan.wide_columns)),
    )
    for g, how in ways:
        if g is not None and g.rows.shape[0] == batch:  # every row (rows are in order): no gather, no scatter
            return how(logits, g)
    ids = logits.argmax(dim=-1)  # the greedy rows' (the drawn rows' are replaced)
    for g, how in ways:
        if g is not None:
            ids[g.rows] = how(logits.index_select(0, g.rows), g)
    return ids


def _draw_top(logits: torch.Tensor, g: DrawRows, columns: int) -> torch.Tensor:
    """From each row's `columns` largest logits (at least its top-k; a seeded row's noise is keyed by token id, so
    the draw does not depend on how many columns its group took, ties at its k-th logit aside)."""
    values, ids = logits.topk(min(columns, logits.shape[1]), dim=-1)  # each [R, K], largest first
    values = values / g.temperature[:, None]
    if g.any_min_p:
        values = _cut_min_p(values, values[:, :1], g.log_min_p)
    values = cut_sorted(values, g.top_k, g.top_p)
    choice = (values.softmax(dim=-1) / _noise(g, ids)).argmax(dim=-1)  # [R]
    return ids.gather(1, choice[:, None]).squeeze(1)


def _draw_nucleus(logits: torch.Tensor, g: DrawRows) -> torch.Tensor:
    return kernels.nucleus_draw(logits, g.temperature, g.top_p, g.log_min_p, g.seed, g.step)


def _cut_min_p(scaled: torch.Tensor, top: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """min_p: an id whose probability is under min_p times the most likely id's, i.e. whose scaled logit is under the
    largest [R, 1] plus log(min_p), set to -inf. In vLLM's order: after the temperature, before top-k and top-p (HF
    cuts by min_p last; top-p then reads the mass left after min_p's cut, so the two orders can keep different
    ids)."""
    return scaled.masked_fill(scaled < top + log_min_p[:, None], float("-inf"))


def cut_sorted(ordered: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logits sorted largest first [R, n] with those past each row's top-k, then past its top-p mass, set to -inf
    (HF's order: top-k first; top-p keeps the smallest prefix whose mass reaches p, the first always)."""
    ranks = torch.arange(ordered.shape[1], device=ordered.device)[None, :]
    ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return ordered.masked_fill(drop, float("-inf"))


def _noise(g: DrawRows, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [R, n] for the columns whose token ids are `ids` ([R, n], or [1, n] shared by every row)."""
    shape = (g.rows.shape[0], ids.shape[1])
    noise = torch.empty(shape, device=ids.device).exponential_()
    if g.any_seeded:
        noise = torch.where(g.seeded[:, None], -torch.log(seeded_uniform(g.seed, g.step, ids)), noise)
    return noise
