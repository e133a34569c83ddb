"""Shared-memory segments made ahead of time, so that writing an image's embeddings into the cache (or an image
file for a preprocessing worker: `stage`) is a memcpy.

A new segment costs more than the copy into it: the tmpfs allocates and zeroes its pages (`reserve`), and each 4 KiB
page faults into the writer's mapping on its first touch. For one 896 px image of a 7B model (~7 MB) that was
~5 ms of one core here against <1 ms for the copy, and 7.8 ms of an H100 host's visual process, on the path of the
request's first token. A few spare segments are therefore kept allocated and mapped with their pages populated, by
a thread that refills them at the lowest CPU priority once a write is done; a write takes the smallest spare that
fits, fills it, cuts it to the entry's size and renames it to the entry's name (`publish_segment`). From there on it
is an ordinary entry: the index owner unlinks it at eviction and the server's stop sweeps it with the others. A
write that finds no spare that fits makes its segment as before.

Spares are named `<prefix><tag><n>` (`spare` for embeddings): a server's stop removes them with its other segments,
and a restarted visual process removes the spares of the one before it. They are sized after the largest entries
written lately (at most `_MAX_SPARE_BYTES`), and made only while /dev/shm has room for `_ROOM_FACTOR` times their
size, so that on a small /dev/shm (a container's 64 MB default) they never take the cache's room.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from visual.shm_segments import (
    create_mapped,
    embedding_nbytes,
    fill_embedding,
    free_bytes,
    publish_segment,
    segment_name,
    unlink_all,
    unlink_segment,
    write_embedding,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SPARE = "spare"
_MAX_SPARE_BYTES = 64 << 20  # larger entries (long videos) are written the old way
_ROOM_FACTOR = 8
_RECENT_WRITES = 32  # the spares' size: the largest of this many latest entries
_SIZE_STEP = 1 << 20  # spare sizes are rounded up to this, so that entries a little larger than the last still fit


@dataclass
class _Spare:
    name: str
    mapping: mmap.mmap
    size: int


class SpareSegments:
    """`write` from any thread (the encoder's copy threads); `close` once, from the owner."""

    def __init__(self, prefix: str, count: int = 4, tag: str = _SPARE):
        """tag: the spares are named `<prefix><tag><n>` (another user of spares in the same process takes its own)."""
        self.prefix = prefix
        self.count = count
        self.tag = tag
        self.taken = 0  # writes that found a spare (for tests and logs)
        self._lock = threading.Lock()
        self._spares: list[_Spare] = []
        self._used: list[_Spare] = []  # written and published: their mappings are closed by the refill thread
        self._to_unlink: list[str] = []  # staged segments whose reader is done: unlinked by the refill thread
        self._recent: deque[int] = deque(maxlen=_RECENT_WRITES)
        self._numbers = itertools.count()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        unlink_all(prefix + tag)  # the spares of a visual process that died before us

    def write(self, key: str, embeds: torch.Tensor) -> None:
        """`embeds` [num_tokens, hidden] (any device) into the segment of `key`, replacing any segment of that name."""
        nbytes = embedding_nbytes(embeds)
        spare = self._take(nbytes)
        if spare is None:
            self._write_new(key, embeds)
            return
        try:
            fill_embedding(spare.mapping, embeds)
            publish_segment(spare.name, segment_name(self.prefix, key), nbytes)
        except BaseException:
            unlink_segment(spare.name)
            raise
        finally:
            self._retire(spare)

    def stage(self, data: bytes) -> str | None:
        """`data` copied into a spare, whose name is returned (None: no spare fits; the caller sends `data` another
        way). The caller owns that segment from here on and unlinks it when its reader is done."""
        spare = self._take(len(data))
        if spare is None:
            return None
        try:
            spare.mapping[: len(data)] = data
        except BaseException:
            unlink_segment(spare.name)
            raise
        finally:
            self._retire(spare)
        return spare.name

    def unlink_later(self, name: str) -> None:
        """Unlink a segment `stage` returned, on the refill thread: freeing its pages (~0.3 ms for 2.4 MB) would
        otherwise delay whatever runs next on the caller's thread."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._to_unlink.append(name)
        if closed:
            unlink_segment(name)
        self._wake.set()

    def expect(self, embeds: list[torch.Tensor]) -> None:
        """Make spares for entries like these (a warm-up batch's) now, before the first image is written."""
        with self._lock:
            self._recent.extend(embedding_nbytes(e) for e in embeds)
            self._start_refill()
        self._wake.set()

    def _write_new(self, key: str, embeds: torch.Tensor) -> None:
        """The old way: a new segment. If /dev/shm is full, the spares give their room back and it is tried again."""
        try:
            write_embedding(self.prefix, key, embeds)
        except OSError as e:
            if e.errno != errno.ENOSPC or not self._drop_spares():
                raise
            write_embedding(self.prefix, key, embeds)

    def _take(self, nbytes: int) -> _Spare | None:
        with self._lock:
            if self._closed:
                return None
            self._recent.append(nbytes)
            fitting = [s for s in self._spares if s.size >= nbytes]
            spare = min(fitting, key=lambda s: s.size) if fitting else None
            if spare is not None:
                self._spares.remove(spare)
                self.taken += 1
            elif self._spares:  # all too small: the smallest makes way for one of the size written now
                smallest = min(self._spares, key=lambda s: s.size)
                self._spares.remove(smallest)
                self._used.append(smallest)
                unlink_segment(smallest.name)
            self._start_refill()
        if spare is None:
            self._wake.set()  # (else once the spare is written: the refill must not compete with that copy)
        return spare

    def _retire(self, spare: _Spare) -> None:
        """Its mapping is closed on the refill thread: unmapping a few MB of pages costs ~0.5 ms, off the path."""
        with self._lock:
            self._used.append(spare)
        self._wake.set()

    def _drop_spares(self) -> bool:
        with self._lock:
            dropped, self._spares = self._spares, []
            self._used += dropped
        for spare in dropped:
            unlink_segment(spare.name)
        self._wake.set()
        return bool(dropped)

    def _start_refill(self) -> None:
        if self._thread is None:  # (under the lock)
            self._thread = threading.Thread(target=self._refill_loop, name="visual-spare-segments", daemon=True)
            self._thread.start()

    def _refill_loop(self) -> None:
        # Below the process's other threads, and the host's other processes, on a busy host: spares are for later.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            self._wake.wait()
            self._wake.clear()
            self._close_used()
            while (size := self._wanted_size()) is not None:
                spare = self._make(size)
                if spare is None:
                    break
                with self._lock:
                    if not self._closed:
                        self._spares.append(spare)
                        continue
                _discard(spare)
            if self._closed:
                self._close_used()
                return

    def _wanted_size(self) -> int | None:
        """The size of the next spare to make, or None while there are enough (or no room, or nothing taken)."""
        with self._lock:
            if self._closed or len(self._spares) >= self.count or not self._recent:
                return None
            size = -(-max(self._recent) // _SIZE_STEP) * _SIZE_STEP
        if size > _MAX_SPARE_BYTES or free_bytes() < _ROOM_FACTOR * size:
            return None
        return size

    def _make(self, size: int) -> _Spare | None:
        name = f"{self.prefix}{self.tag}{next(self._numbers)}"
        try:
            return _Spare(name, create_mapped(name, size, populate=True), size)
        except OSError as e:  # /dev/shm filled up meanwhile: writes go the old way until there is room again
            logger.debug("no spare embedding segment of %d bytes: %s", size, e)
            return None

    def _close_used(self) -> None:
        with self._lock:
            used, self._used = self._used, []
            names, self._to_unlink = self._to_unlink, []
        for spare in used:
            spare.mapping.close()
        for name in names:
            unlink_segment(name)

    def close(self) -> None:
        """Unlink the spares and stop the refill thread (entries already written stay)."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
            thread = self._thread
        for spare in spares:
            _discard(spare)
        self._wake.set()
        if thread is not None:
            thread.join()
        self._close_used()


def _discard(spare: _Spare) -> None:
    unlink_segment(spare.name)
    spare.mapping.close()
