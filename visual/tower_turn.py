"""Turns on the GPU the visual process and the router share: two flags in shared memory, one written by each side.

The visual process and the router share one GPU from two processes, and the GPU time-slices between them. Under a
burst of new images the router's decode steps for the requests already running took most of the GPU: a tower batch
of eight 336 px images took 85 ms instead of 15 ms, the images behind it waited, and so did those requests' first
tokens. The visual process raises this flag while a batch runs; the router holds back a step that would only decode
while the flag is up (at most `--tower_turn_ms` per step), so images get through the tower and reach the LM sooner.
Steps with prompt tokens to prefill never wait.

The other flag is the router's, up while a step with prompt tokens runs on the GPU. With `--tower_yield_ms`, the
tower hands the GPU to those steps between its blocks (`visual/prefill_yield.py`): a request whose images are done
is nearer its first token than one still in the tower, and under a burst of large images the two had time-sliced
the GPU, each tower batch and each prompt step taking about twice its time alone.

A flag is the time (CLOCK_MONOTONIC, one clock for every process of the host) the batch started, 0 when none
runs; a flag older than `_STALE_S` is ignored, so a visual process that died mid-batch holds nothing back. The
segment is named after the server's shared-memory prefix (the parent's sweep at stop removes it with the
embeddings), and the router maps it again every second: the visual process may start after it, or restart.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

from visual.shm_segments import open_segment, unlink_segment

_NAME = "tower_turn"
_FLAG = struct.Struct("<d")  # monotonic seconds at which the running batch (or prompt step) started; 0.0: none runs
_TOWER, _PREFILL = 0, _FLAG.size  # offsets of the two flags
_STALE_S = 10.0  # no batch takes this long: a flag this old was left by a process that died
_REOPEN_S = 1.0  # how often the router maps the segment again
_POLL_S = 0.0005  # how often the visual process reads the router's flag while it waits


class TowerTurn:
    """`create`, `batch_running` and `wait_for_prefill` in the visual process; `is_up` and `set_prefill` in the
    router. Each side writes its own flag only. Picklable (only the name travels): each process maps the segment
    itself."""

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
        self._shm = open_segment(self.name, create=True, size=2 * _FLAG.size)
        self.lower_flag()
        self._write(_PREFILL, 0.0)

    def raise_flag(self) -> None:
        self._write(_TOWER, time.monotonic())

    def lower_flag(self) -> None:
        self._write(_TOWER, 0.0)

    @contextlib.contextmanager
    def batch_running(self) -> Iterator[None]:
        """The flag up for the `with` block: one tower batch, until its embeddings are back on the host."""
        self.raise_flag()
        try:
            yield
        finally:
            self.lower_flag()

    def prefill_running(self) -> bool:
        """The router's flag: a step with prompt tokens runs."""
        return self._up(_PREFILL)

    def wait_for_prefill(self, limit_s: float) -> float:
        """While the router's prompt steps run, wait (at most limit_s); returns the seconds waited."""
        start = time.monotonic()
        while self._up(_PREFILL) and time.monotonic() - start < limit_s:
            time.sleep(_POLL_S)
        return time.monotonic() - start

    # ---- the router
    def is_up(self) -> bool:
        """The tower runs a batch."""
        self._map_again_in_time()
        return self._up(_TOWER)

    def set_prefill(self, running: bool) -> None:
        """The router's flag: up (stamped now, so that it never reads as stale while prompt steps follow each
        other) while a step with prompt tokens runs, down otherwise."""
        self._map_again_in_time()
        self._write(_PREFILL, time.monotonic() if running else 0.0)

    def _map_again_in_time(self) -> None:
        now = time.monotonic()
        if now >= self._next_open:  # the visual process may have started since, or restarted with a new segment
            self._reopen(now)

    # ---- both
    def _up(self, offset: int) -> bool:
        if self._shm is None:
            return False
        (started,) = _FLAG.unpack_from(self._shm.buf, offset)
        return started != 0.0 and time.monotonic() - started < _STALE_S

    def _write(self, offset: int, value: float) -> None:
        if self._shm is not None:
            _FLAG.pack_into(self._shm.buf, offset, value)

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
