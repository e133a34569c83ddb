"""Admission and batching: the Efficient Router with chunked prefill.

Every step decodes each running request once and spends up to `prefill_budget` prompt tokens on prefill: first the
requests whose prompts are part-way through, then waiting requests in arrival order. A prompt longer than what is
left of the budget is split across steps (chunked prefill) unless chunking is off.

A waiting request is admitted only if the projected peak KV use stays within the cache, so decoding never runs out
of slots. Decoding requests grow in lockstep, one slot per step, which LightLLM's sorted projection counts exactly;
a request that is still prefilling may start growing any number of steps later, so it is counted at its own peak
(prompt + max_new_tokens - 1 slots) for the whole horizon.

With the prefix cache, a request counts only the slots it owns: its first `cached_len` tokens belong to the tree.
The tree's slots that some running request locks are subtracted from the capacity; the unlocked ones count as free
(staging evicts them when the allocator runs short). A waiting request reuses the longest cached prefix of its
prompt (never the whole prompt: its last token must run to give logits)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from language.prefix_cache import Node, PrefixCache
from language.request import Request, RequestStatus

# A request that asks for prompt_logprobs runs the head over every prompt position of its chunk ([rows, vocab] fp32
# logits: 620 MB for 1024 rows of a 152k vocabulary), so with chunked prefill its chunks are at most this long.
SCORED_CHUNK_TOKENS = 1024


def peak_slots(req: Request) -> int:
    """The most slots a request ever holds: the last sampled token is never stored."""
    return req.prompt_len + req.params.max_new_tokens - 1


def lockstep_peak(usage: list[tuple[int, int]]) -> int:
    """Peak total slots of (held, remaining) requests that all add one slot per step until done: sorted by
    remaining (longest first), the batch peaks just before the i-th request finishes, holding the first i requests'
    slots plus i x its remaining."""
    peak, held_sum = 0, 0
    for i, (held, remaining) in enumerate(sorted(usage, key=lambda hr: -hr[1]), start=1):
        held_sum += held
        peak = max(peak, held_sum + remaining * i)
    return peak


def own_peak(req: Request) -> int:
    """The most slots a request owns (its cached prefix is the tree's)."""
    return peak_slots(req) - req.cached_len


def projected_peak(decoding: list[Request], fixed: int) -> int:
    """Peak slots if `decoding` each store one token this step and every following step until max_new_tokens, while
    the other requests hold `fixed` slots at most throughout. A request's last sample is read back a step after it
    is launched, so it holds its full peak one step longer than it grows: counted as one more step of growth."""
    now = fixed + sum(r.kv_len - r.cached_len + 1 for r in decoding)
    later = [(r.kv_len - r.cached_len + 1, peak_slots(r) - r.kv_len) for r in decoding]
    return max(now, fixed + lockstep_peak(later))


@dataclass(frozen=True)
class PrefillChunk:
    req: Request
    start: int  # first prompt token of the chunk
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_last(self) -> bool:
        """The chunk that completes the prompt: its last row's logits give the first output token."""
        return self.end == self.req.prompt_len


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # one token each, sampled by the previous step
    prefill: list[PrefillChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # newly running this step (need a table row)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)


def whole_image_chunk(req: Request, start: int, length: int) -> int:
    """A chunk's length moved off any image it would end inside: back to the image's start if the chunk holds
    anything before it, else on to the image's end (over the budget: one image is never split)."""
    end = start + length
    for item in req.mm_items:
        first, last = item.offset, item.offset + item.num_tokens
        if first < end < last:
            end = first if first > start else last
    return end - start


class Scheduler:
    def __init__(
        self,
        max_total_token_num: int,
        running_max_req_size: int,
        prefill_budget: int,
        chunked_prefill: bool,
        prefix: PrefixCache | None = None,
        whole_images: bool = False,
    ):
        """whole_images: a chunk never ends inside an image's placeholders (a decoder whose image tokens attend to
        each other both ways, `bidirectional_images`: the image's first rows would otherwise run before the rest of
        it is in the cache)."""
        self.max_total_token_num = max_total_token_num
        self.running_max_req_size = running_max_req_size
        self.prefill_budget = prefill_budget
        self.chunked_prefill = chunked_prefill
        self.prefix = prefix
        self.whole_images = whole_images
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.peak_tokens = 0  # sum of peak_slots over `running`, kept as requests come and go (EngineStats)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_prompt_work(self) -> bool:
        return bool(self.waiting) or any(r.prefilling for r in self.running)

    def prompt_backlog_fills_step(self) -> bool:
        """The prompts already here (part-way prefilled, then waiting) hold at least a step's prefill budget: a
        prompt arriving now could not join the next step anyway."""
        return self.prompt_backlog(self.prefill_budget) >= self.prefill_budget

    def prompt_backlog(self, cap: int) -> int:
        """Prompt tokens still to prefill (part-way prefilled requests, then waiting ones), counted up to cap: a
        long queue is not walked to the end."""
        tokens = 0
        for req in itertools.chain((r for r in self.running if r.prefilling), self.waiting):
            tokens += req.prompt_len - req.kv_len
            if tokens >= cap:
                return cap
        return tokens

    def remove(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.peak_tokens -= peak_slots(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._unreserve(req)

    def reserve_prefix(self, req: Request) -> bool:
        """For a request with images sent without embeddings: whether the cached prefix it would reuse covers all
        of them; if so, that prefix is locked until the request is admitted (or removed), so that admission reuses
        at least that much and never reads those images' rows."""
        node, matched = self._match(req)
        if node is None or any(i.embeds is None and i.offset + i.num_tokens > matched for i in req.mm_items):
            return False
        self.prefix.lock(node)
        req.reserved_node = node
        return True

    def _unreserve(self, req: Request) -> None:
        if req.reserved_node is not None:
            self.prefix.unlock(req.reserved_node)
            req.reserved_node = None

    def schedule(self, has_free_row: Callable[[int], bool]) -> StepPlan:
        """The next step's work. Requests whose launched steps already sample their last token sit out."""
        plan = StepPlan(decode=[r for r in self.running if not r.prefilling and not r.sampling_done])
        budget = self.prefill_budget
        capacity = self.max_total_token_num - (self.prefix.protected_tokens if self.prefix else 0)
        fixed = 0  # slots owned at most by the requests that are not decoding this step
        for r in self.running:
            if r.prefilling:
                fixed += own_peak(r)
                if budget > 0:
                    budget -= self._take_chunk(plan, r, budget)
            elif r.sampling_done:
                fixed += r.kv_len - r.cached_len
        while self.waiting and budget > 0 and len(self.running) < self.running_max_req_size:
            cand = self.waiting[0]
            if not has_free_row(len(plan.admitted)):
                break
            if not self.chunked_prefill and cand.prompt_len > budget and plan.prefill:
                break  # whole prompts only: this one waits for a step with room
            node, matched = self._match(cand)
            newly_locked = self.prefix.unprotected_tokens(node) if node is not None else 0
            if projected_peak(plan.decode, fixed + peak_slots(cand) - matched) > capacity - newly_locked:
                break  # FIFO: later requests wait behind it rather than starve it
            self.waiting.popleft()
            if node is not None:
                self._reuse(cand, node, matched)
            cand.status = RequestStatus.RUNNING
            self.running.append(cand)
            self.peak_tokens += peak_slots(cand)
            plan.admitted.append(cand)
            capacity -= newly_locked
            fixed += own_peak(cand)
            budget -= self._take_chunk(plan, cand, budget)
        return plan

    def _match(self, req: Request) -> tuple[Node | None, int]:
        """The cached prefix a waiting request would reuse: (its node, its length); (None, 0) without the cache."""
        if self.prefix is None or req.cache_ids is None:
            return None, 0
        return self.prefix.match(req.cache_ids[: req.prompt_len - 1])

    def _reuse(self, req: Request, node: Node, length: int) -> None:
        self.prefix.lock(node)
        self._unreserve(req)  # the path just locked holds the reserved one (it cannot have been evicted)
        self.prefix.hit_tokens += length
        req.prefix_node = node
        req.kv_len = req.cached_len = req.prompt_cache_len = length
        req.kv_slots = self.prefix.path_slots(node)

    def _take_chunk(self, plan: StepPlan, req: Request, budget: int) -> int:
        remaining = req.prompt_len - req.kv_len
        if self.chunked_prefill and req.prompt_logprobs is not None:
            budget = min(budget, SCORED_CHUNK_TOKENS)
        length = min(remaining, budget) if self.chunked_prefill else remaining
        if self.whole_images and length < remaining:
            length = whole_image_chunk(req, req.kv_len, length)
        plan.prefill.append(PrefillChunk(req, req.kv_len, length))
        return length
