"""One step's inputs, built on the host while the previous step still runs on the GPU.

Staging a StepPlan allocates the KV slots its tokens are written to, advances each request's `kv_len` and
`num_sampled`, and lays the step's integer inputs out as numpy arrays: decode rows first (one token each, whose id
the device already holds), then the prefill chunks. Nothing here touches the device; `ModelRunner` packs the arrays
into one pinned buffer and sends it in a single copy.

A request that reuses a cached prefix gets its table row's first columns pointed at the tree's slots in the same
copy (`table_*`), and a prompt that completes is handed to the prefix cache, so requests staged later reuse it.

Where the previous step is read back between staging and launch (an eager prompt step under the router),
`drop_finished` takes out the decode rows of requests it finished; otherwise such a row runs and its sample is
ignored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from language.kv_cache import KVCache
from language.prefix_cache import PrefixCache
from language.request import Request
from language.scheduler import StepPlan


@dataclass
class DecodeRows:
    """[D] arrays, one row per decoding request: it stores its latest sampled token at kv position `col`."""

    reqs: list[Request]
    req_idx: np.ndarray  # int64 table row
    col: np.ndarray  # int64 kv position of the stored token (seq_len after this step = col + 1)
    position: np.ndarray  # int64 rotary position (col + the request's M-RoPE delta)
    slot: np.ndarray  # int64 KV slot of the stored token

    def keep(self, mask: np.ndarray) -> DecodeRows:
        return DecodeRows(
            [r for r, k in zip(self.reqs, mask, strict=True) if k],
            self.req_idx[mask],
            self.col[mask],
            self.position[mask],
            self.slot[mask],
        )


@dataclass
class PrefillRows:
    """The prefill chunks: [T] arrays per token and [P] arrays per chunk."""

    reqs: list[Request]
    samples: np.ndarray  # bool [P]: the chunk completes its prompt, so its last row's token is kept
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [A, T], A = 1 or 3 (M-RoPE)
    tok_req_idx: np.ndarray  # int64 [T] table row of each token
    tok_col: np.ndarray  # int64 [T] kv position of each token
    slot: np.ndarray  # int64 [T]
    req_idx: np.ndarray  # int64 [P]
    q_start: np.ndarray  # int64 [P] first row of the chunk within the prefill part
    q_len: np.ndarray  # int64 [P]
    seq_len: np.ndarray  # int64 [P] kv length after this step
    mm_embeds: list[torch.Tensor]  # host views [m_i, hidden] of the image rows in these chunks
    mm_rows: np.ndarray  # int64 [M] row of each image embedding within the prefill part
    # Bidirectional image blocks, on a step with image rows: int64 [T], the kv position each row's keys reach
    # (exclusive): its image's end, 0 for text (ForwardBatch.prefill_key_ends); else empty
    key_ends: np.ndarray
    # Table entries of cached prefixes reused by newly admitted requests: [R] each
    table_req_idx: np.ndarray
    table_col: np.ndarray
    table_slot: np.ndarray
    # prompt_logprobs: the rows (within the prefill part) whose logits score the next prompt token, that token, and
    # per chunk that asks (request, how many of those rows are its own), in row order
    score_rows: np.ndarray  # int64 [S]
    score_targets: np.ndarray  # int64 [S]
    scored: list[tuple[Request, int]]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StagedStep:
    decode: DecodeRows
    prefill: PrefillRows

    @property
    def num_seqs(self) -> int:
        return len(self.decode.reqs) + len(self.prefill.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.decode.reqs) + self.prefill.num_tokens

    def drop_finished(self) -> None:
        """Remove decode rows whose request finished meanwhile (finishing freed every slot it held, the one staged
        here included)."""
        mask = np.array([not r.finished for r in self.decode.reqs], dtype=np.bool_)
        if not mask.all():
            self.decode = self.decode.keep(mask)


def stage(
    plan: StepPlan, kv: KVCache, position_dims: int, prefix: PrefixCache | None = None, bidirectional: bool = False
) -> StagedStep:
    """bidirectional: the decoder's image tokens see their whole image (`bidirectional_images`): the prefill rows of
    a step with images carry `key_ends`."""
    for r in plan.admitted:
        r.req_idx = kv.allocate_row()
    if prefix is not None:
        prefix.make_room(plan.num_tokens)  # admission counted the unlocked tree slots as free
    decode = _stage_decode(plan.decode, kv)
    return StagedStep(decode, _stage_prefill(plan, kv, position_dims, prefix, bidirectional))


def _stage_decode(reqs: list[Request], kv: KVCache) -> DecodeRows:
    n = len(reqs)
    slots = kv.slots.allocate(n)
    req_idx = np.empty(n, dtype=np.int64)
    col = np.empty(n, dtype=np.int64)
    delta = np.empty(n, dtype=np.int64)
    for i, r in enumerate(reqs):
        req_idx[i], col[i], delta[i] = r.req_idx, r.kv_len, r.position_delta
        r.kv_len += 1
        r.num_sampled += 1
        r.kv_slots.append(int(slots[i]))
    return DecodeRows(list(reqs), req_idx, col, col + delta, slots)


def _stage_prefill(
    plan: StepPlan, kv: KVCache, position_dims: int, prefix: PrefixCache | None, bidirectional: bool
) -> PrefillRows:
    reused = [r for r in plan.admitted if r.prompt_cache_len]
    table_len = np.array([r.prompt_cache_len for r in reused], dtype=np.int64)
    table_slot = np.concatenate([np.asarray(r.kv_slots[: r.prompt_cache_len], np.int64) for r in reused] or [[]])
    table_slot = table_slot.astype(np.int64, copy=False)
    chunks = plan.prefill
    q_len = np.array([c.length for c in chunks], dtype=np.int64)
    q_start = np.cumsum(q_len) - q_len
    total = int(q_len.sum())
    slots = kv.slots.allocate(total)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty((position_dims, total), dtype=np.int64)
    tok_col = np.empty(total, dtype=np.int64)
    mm_embeds: list[torch.Tensor] = []
    mm_rows: list[np.ndarray] = []
    block_rows: list[tuple[np.ndarray, int]] = []  # (rows, the image's end) of the images in these chunks
    score_rows: list[np.ndarray] = []
    score_targets: list[np.ndarray] = []
    scored: list[tuple[Request, int]] = []
    for c, base in zip(chunks, q_start.tolist(), strict=True):
        r, rows = c.req, slice(base, base + c.length)
        input_ids[rows] = r.prompt_ids[c.start : c.end]
        if r.prompt_logprobs is not None:  # every position but the prompt's last scores the token after it
            n = min(c.end, r.prompt_len - 1) - c.start
            if n > 0:
                score_rows.append(np.arange(base, base + n))
                score_targets.append(np.asarray(r.prompt_ids[c.start + 1 : c.start + 1 + n], dtype=np.int64))
                scored.append((r, n))
        tok_col[rows] = np.arange(c.start, c.end)
        if r.positions is not None:
            positions[:, rows] = r.positions[:, c.start : c.end].numpy()
        else:
            positions[:, rows] = tok_col[rows]
        for item in r.mm_items:  # the image rows that fall inside this chunk
            lo, hi = max(item.offset, c.start), min(item.offset + item.num_tokens, c.end)
            if lo < hi:
                mm_embeds.append(item.embeds[lo - item.offset : hi - item.offset])
                mm_rows.append(np.arange(base + lo - c.start, base + hi - c.start))
                block_rows.append((mm_rows[-1], item.offset + item.num_tokens))
        r.kv_slots.extend(slots[rows].tolist())
        r.kv_len = c.end
        if c.is_last:
            r.num_sampled += 1
            if r.prefix_node is not None:
                prefix.adopt(r, r.cache_ids, r.prompt_len)
    req_idx = np.array([c.req.req_idx for c in chunks], dtype=np.int64)
    key_ends = np.empty(0, dtype=np.int64)
    if bidirectional and block_rows:
        key_ends = np.zeros(total, dtype=np.int64)
        for rows, end in block_rows:
            key_ends[rows] = end
    return PrefillRows(
        reqs=[c.req for c in chunks],
        samples=np.array([c.is_last for c in chunks], dtype=np.bool_),
        input_ids=input_ids,
        positions=positions,
        tok_req_idx=np.repeat(req_idx, q_len),
        tok_col=tok_col,
        slot=slots,
        req_idx=req_idx,
        q_start=q_start,
        q_len=q_len,
        seq_len=np.array([c.end for c in chunks], dtype=np.int64),
        mm_embeds=mm_embeds,
        mm_rows=np.concatenate(mm_rows) if mm_rows else np.empty(0, dtype=np.int64),
        key_ends=key_ends,
        table_req_idx=np.repeat(np.array([r.req_idx for r in reused], dtype=np.int64), table_len),
        table_col=np.concatenate([np.arange(n) for n in table_len.tolist()]) if reused else table_slot.copy(),
        table_slot=table_slot,
        score_rows=np.concatenate(score_rows) if scored else np.empty(0, dtype=np.int64),
        score_targets=np.concatenate(score_targets) if scored else np.empty(0, dtype=np.int64),
        scored=scored,
    )
