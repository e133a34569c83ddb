"""The vision tower's turn on the GPU: a flag in shared memory, up while the tower runs a batch, and beside it the
router's backlog of prompt tokens, which keeps the tower from running far ahead of the LM.

The visual process and the router share one GPU from two processes, and the GPU time-slices between them. Under a
burst of new images the router's decode steps for the requests already running took most of the GPU: a tower batch
of eight 336 px images took 85 ms instead of 15 ms, the images behind it waited, and so did those requests' first
tokens. The visual process raises this flag while a batch runs; the router holds back a step that would only decode
while the flag is up (at most `--tower_turn_ms` per step), so images get through the tower and reach the LM sooner.
Steps with prompt tokens to prefill never wait.

The other way round: under a burst of large images the tower, left alone, encodes the whole burst while the router
prefills its first prompts on the same GPU, so every early request's prefill shares the GPU with towers for requests
far behind it. The router writes how many prompt tokens wait for prefill (embeddings ready, admitted); the visual
process holds its next batch while that backlog is at least `--tower_lookahead_tokens` (`VisualEncoder`), so the GPU
goes to the prompts at the front and the tower stays a few prompts ahead (a batch of that many tokens or more, a long
clip's, is not held).

The flag is the time (CLOCK_MONOTONIC, one clock for every process of the host) the batch started, 0 when none
runs; a flag older than `_STALE_S` is ignored, so a visual process that died mid-batch holds nothing back. The
backlog carries the time it was written: one older than `_BACKLOG_STALE_S` (a router that stopped) holds nothing
back. The segment is named after the server's shared-memory prefix (the parent's sweep at stop removes it with the
embeddings), and the router maps it again every second: the visual process may start after it, or restart.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

from visual.shm_segments import open_segment, unlink_segment

_NAME = "tower_turn"
_FLAG = struct.Struct("<d")  # monotonic seconds at which the running batch started; 0.0: none runs
_BACKLOG = struct.Struct("<dq")  # after the flag: monotonic seconds when written, prompt tokens waiting for prefill
_STALE_S = 10.0  # no batch takes this long: a flag this old was left by a visual process that died
_REOPEN_S = 1.0  # how often the reader maps the segment again
_BACKLOG_STALE_S = 1.0  # the router writes it every loop turn (steps take at most ~0.2 s): older, it stopped


class TowerTurn:
    """`create`, `batch_running` and `prompt_backlog` in the visual process; `is_up` and `publish_backlog` in the
    router. Picklable (only the name travels): each process maps the segment itself."""

    def __init__(self, shm_prefix: str) -> None:
        self.name = shm_prefix + _NAME
        self._shm = None
        self._next_open = 0.0

    def __getstate__(self) -> dict:
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__("")
        self.name = state["name"]

    # ---- the visual process
    def create(self) -> None:
        unlink_segment(self.name)  # a previous visual process's, if it died
        self._shm = open_segment(self.name, create=True, size=_FLAG.size + _BACKLOG.size)
        self.lower_flag()

    def raise_flag(self) -> None:
        if self._shm is not None:
            _FLAG.pack_into(self._shm.buf, 0, time.monotonic())

    def lower_flag(self) -> None:
        if self._shm is not None:
            _FLAG.pack_into(self._shm.buf, 0, 0.0)

    @contextlib.contextmanager
    def batch_running(self) -> Iterator[None]:
        """The flag up for the `with` block: one tower batch, until its embeddings are back on the host."""
        self.raise_flag()
        try:
            yield
        finally:
            self.lower_flag()

    def prompt_backlog(self) -> int:
        """The prompt tokens the router last said wait for prefill; 0 when it has not written for a while."""
        if self._shm is None:
            return 0
        written, tokens = _BACKLOG.unpack_from(self._shm.buf, _FLAG.size)
        return tokens if time.monotonic() - written < _BACKLOG_STALE_S else 0

    # ---- the router
    def is_up(self) -> bool:
        now = time.monotonic()
        buf = self._mapped(now)
        if buf is None:
            return False
        (started,) = _FLAG.unpack_from(buf, 0)
        return started != 0.0 and now - started < _STALE_S

    def publish_backlog(self, tokens: int) -> None:
        now = time.monotonic()
        buf = self._mapped(now)
        if buf is not None:
            _BACKLOG.pack_into(buf, _FLAG.size, now, tokens)

    def _mapped(self, now: float) -> memoryview | None:
        if now >= self._next_open:  # the visual process may have started since, or restarted with a new segment
            self._reopen(now)
        return None if self._shm is None else self._shm.buf

    def _reopen(self, now: float) -> None:
        self._next_open = now + _REOPEN_S
        self.close()
        try:
            self._shm = open_segment(self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
