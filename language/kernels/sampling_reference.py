"""Plain-torch references for the sampling kernels (greedy_sample.py, penalties.py, nucleus_draw.py): the definition
of what each computes, and the path the engine takes when there is no GPU."""

from __future__ import annotations

import torch


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax ids [B] int64, their log-probabilities [B] fp32), on the fp32 upcast: the first
    index among equal maxima (NaN counts as the maximum), log_softmax gathered as chosen - logsumexp."""
    x = logits.float()
    ids = x.argmax(dim=-1)
    return ids, x.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(x, dim=-1)


def penalize_ref(
    logits: torch.Tensor,
    table_rows: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] fp32 -> penalised, out of place: HF's repetition penalty over the ids the prompt holds or that
    came out (positive logits divided, negative multiplied), then OpenAI's frequency (per count) and presence (once)
    penalties. table_rows [B] index counts [T, V] fp32 and in_prompt [T, V] bool."""
    row_counts = counts.index_select(0, table_rows)  # [B, V]
    came_out = row_counts > 0
    seen = in_prompt.index_select(0, table_rows) | came_out
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * row_counts - presence[:, None] * came_out.float()


_MASK32 = 0xFFFFFFFF
NUCLEUS_MAX_ROUNDS = 32  # nucleus_draw's rejection rounds before it takes the most likely id (see its kernel)


def seeded_uniform(seed: torch.Tensor, step: torch.Tensor, ids: torch.Tensor, round_: int = 0) -> torch.Tensor:
    """Counter-based uniform noise in (0, 1) from (seed, step, token id, round): seed and step [R], ids [R, n] or
    [1, n] -> [R, n] fp32. A 32-bit mix kept inside int64 (products wrap; only the low 32 bits are kept), then its
    top 23 bits, so that the fp32 value is exact and below 1 (the full 32 bits round up to 1.0 near the top, and an
    Exp(1) draw of -log(1) = 0 would win any race)."""
    x = (seed[:, None] ^ (seed[:, None] >> 32)) & _MASK32
    x = (x * 0x9E3779B1 + step[:, None] * 0x85EBCA77 + ids * 0xC2B2AE3D + round_ * 0x27D4EB2F) & _MASK32
    for mul in (0x7FEB352D, 0x846CA68B):
        x = ((x ^ (x >> 16)) * mul) & _MASK32
    return unit_interval(x ^ (x >> 16))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 in [0, 2^32)) -> fp32 in (0, 1): the top 23 bits plus a half, exact in fp32 (with 24
    bits the largest rounds up to 1)."""
    return ((x >> 9).float() + 0.5) / 8388608.0


def nucleus_draw_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """logits [R, V] fp32 -> [R] int64: each row's draw from softmax(logits / temperature) cut by min-p (ids whose
    scaled logit is under the largest plus log_min_p) and then top-p (the ids whose mass of strictly likelier ids,
    among those min-p keeps, is under top_p; the most likely ids always), by rejection: an exponential race over
    the ids above a floor (seeded noise of each round), kept if the winner is inside both cuts, else the floor rises
    to the winner's logit (every id at or below it is outside the nucleus too) and the next round races. After
    NUCLEUS_MAX_ROUNDS rounds, the most likely id. All [R] fp32 but seed and step (int64)."""
    scaled = logits / temperature[:, None]  # [R, V]
    top = scaled.amax(dim=-1, keepdim=True)  # [R, 1]
    floor = top + log_min_p[:, None]
    kept_mass = torch.where(scaled >= floor, (scaled - top).exp(), 0.0).sum(dim=-1)  # [R]
    ids = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    low = torch.full_like(top, float("-inf"))  # [R, 1]: the race's floor (exclusive)
    choice = scaled.argmax(dim=-1)
    done = torch.zeros_like(choice, dtype=torch.bool)
    for round_ in range(NUCLEUS_MAX_ROUNDS):
        noise = -torch.log(seeded_uniform(seed, step, ids, round_))  # Exp(1) [R, V]
        key = torch.where(scaled > low, scaled - torch.log(noise), float("-inf"))
        winner = key.argmax(dim=-1, keepdim=True)  # [R, 1]
        at = scaled.gather(1, winner)  # [R, 1]
        above = torch.where(scaled > at, (scaled - top).exp(), 0.0).sum(dim=-1)
        inside = (at >= floor).squeeze(1) & ((top_p >= 1.0) | (above < top_p * kept_mass) | (above == 0.0))
        choice = torch.where(inside & ~done, winner.squeeze(1), choice)
        done = done | inside
        if bool(done.all()):
            break
        low = torch.where(done[:, None], low, at)
    return choice
