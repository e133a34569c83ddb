"""Bookkeeping of the embedding cache, kept by one owner process: which keys are held, encoding or ready, how many
requests use each, and which to evict.

An entry is PENDING from the moment a request first asks for its key until the visual process reports it encoded
(READY) or failed (then it is dropped). Requests acquire all their keys at once or none (so two requests can never
each hold half of the room the other needs), and release them when done. Unreferenced READY entries are evicted
least-recently-used first when room is needed; PENDING ones never are (their segment is still being written).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class CacheCapacityError(ValueError):
    """A request has more distinct images than the cache can ever hold (the server answers 400)."""


class CacheBusy(Exception):
    """Not enough unreferenced room right now; retry after other requests release theirs."""


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(eq=False)
class CacheEntry:
    key: str
    state: EntryState = EntryState.PENDING
    refs: int = 0
    num_tokens: int = 0
    dropped: bool = False  # failed or evicted: releasing it is a no-op


@dataclass
class CacheStats:
    items: int = 0
    hits: int = 0  # keys found READY or PENDING when acquired (no new encode)
    misses: int = 0  # keys that had to be encoded
    evictions: int = 0


class EmbedCacheIndex:
    def __init__(self, capacity: int, on_evict: Callable[[str], None] = lambda key: None):
        """capacity: entries (images) held at most; on_evict(key) frees an evicted entry's storage."""
        if capacity < 1:
            raise ValueError("cache capacity must be >= 1")
        self.capacity = capacity
        self._on_evict = on_evict
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # least recently used first
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_in_use(self) -> int:
        """Entries some request holds a reference to (PENDING or READY)."""
        return sum(1 for e in self._entries.values() if e.refs > 0)

    def lookup(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def acquire(self, keys: list[str]) -> tuple[list[CacheEntry], list[str]]:
        """Reference every key (duplicates count once per occurrence). Returns the entries in the order of `keys`,
        and the keys that are new (PENDING now: the caller must have them encoded). All or nothing: raises
        CacheCapacityError if the distinct keys exceed the capacity, CacheBusy if they do not fit now."""
        distinct = list(dict.fromkeys(keys))
        if len(distinct) > self.capacity:
            raise CacheCapacityError(
                f"the request has {len(distinct)} distinct images but the image cache holds at most "
                f"{self.capacity} (--cache_capacity)"
            )
        new = [k for k in distinct if k not in self._entries]
        self._make_room(len(new))
        for key in new:
            self._entries[key] = CacheEntry(key)
        self.stats.misses += len(new)
        self.stats.hits += len(distinct) - len(new)
        out = []
        for key in keys:
            entry = self._entries[key]
            entry.refs += 1
            self._entries.move_to_end(key)
            out.append(entry)
        self.stats.items = len(self._entries)
        return out, new

    def mark_ready(self, key: str, num_tokens: int) -> CacheEntry | None:
        """The visual process wrote the key's embeddings. None if the entry is gone (nothing to do)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.state, entry.num_tokens = EntryState.READY, num_tokens
        return entry

    def mark_failed(self, key: str) -> CacheEntry | None:
        """Encoding failed: drop the entry (its holders see `dropped` and give up; a later request retries)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.dropped = True
            self.stats.items = len(self._entries)
        return entry

    def release(self, entries: list[CacheEntry]) -> None:
        """Drop one reference per entry given (as returned by acquire)."""
        for entry in entries:
            if entry.dropped:
                continue
            if entry.refs <= 0:
                raise RuntimeError(f"cache entry {entry.key} released more often than acquired")
            entry.refs -= 1

    def evict(self, n: int) -> int:
        """Evict up to n unreferenced READY entries, least recently used first; returns how many."""
        victims = [e for e in self._entries.values() if e.refs == 0 and e.state is EntryState.READY][:n]
        for entry in victims:
            del self._entries[entry.key]
            entry.dropped = True
            self._on_evict(entry.key)
        self.stats.evictions += len(victims)
        self.stats.items = len(self._entries)
        return len(victims)

    def _make_room(self, needed: int) -> None:
        over = len(self._entries) + needed - self.capacity
        if over <= 0:
            return
        evictable = sum(1 for e in self._entries.values() if e.refs == 0 and e.state is EntryState.READY)
        if evictable < over:
            raise CacheBusy(f"{needed} new images need room; {evictable} of {len(self._entries)} entries are free")
        self.evict(over)
