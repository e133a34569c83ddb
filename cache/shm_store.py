"""Embeddings in POSIX shared memory, one segment per cache entry, named `<prefix><key>`.

A segment is a 64-byte header (magic, dtype, shape) followed by the raw [num_tokens, hidden] tensor, so a reader
needs only the key. The visual process writes segments, the router maps them read-only as tensor views
(`torch.frombuffer`, no copy), the index owner unlinks evicted ones, and the server's parent unlinks every segment
with its prefix at stop (the names are all it needs, so this works after a child crashed).
"""

from __future__ import annotations

import os
import secrets
import struct
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

_HEADER = struct.Struct("<4sB3xQQ")  # magic, dtype code, num_tokens, hidden
_DATA_OFFSET = 64
_MAGIC = b"MMEC"
_DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory (for unlink_all)


def new_prefix() -> str:
    """A per-server prefix, unique on the host: every segment of this server starts with it."""
    return f"mmsv_{os.getpid()}_{secrets.token_hex(4)}_"


def segment_name(prefix: str, key: str) -> str:
    return prefix + key


def _open(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    """Open a segment whose lifetime we manage ourselves: Python < 3.13 registers every open with the resource
    tracker, which would unlink it when the opening process exits (and warn), so unregister right away."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, create=create, size=size, track=False)
    shm = SharedMemory(name=name, create=create, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the registered name has its "/"
    return shm


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (mappings that exist stay valid until closed). False if it did not exist."""
    try:
        shm = _open(name)
    except FileNotFoundError:
        return False
    shm.close()
    try:
        if sys.version_info >= (3, 13):
            shm.unlink()
        else:
            from _posixshmem import shm_unlink

            shm_unlink(shm._name)  # noqa: SLF001 - SharedMemory.unlink() would unregister it from the tracker again
    except FileNotFoundError:
        return False
    return True


def list_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix)) if os.path.isdir(_SHM_DIR) else []


def unlink_all(prefix: str) -> int:
    """Unlink every segment of one server (at stop, also after a child crashed); returns how many."""
    return sum(unlink_segment(name) for name in list_segments(prefix))


def write_embedding(prefix: str, key: str, embeds: torch.Tensor) -> None:
    """Write `embeds` [num_tokens, hidden] (any device) into a new segment for `key`."""
    if embeds.dim() != 2 or embeds.dtype not in _DTYPE_CODES:
        raise ValueError(f"expected a 2-D float16/bfloat16/float32 tensor, got {embeds.dtype} {tuple(embeds.shape)}")
    name = segment_name(prefix, key)
    nbytes = embeds.numel() * embeds.element_size()
    try:
        shm = _open(name, create=True, size=_DATA_OFFSET + nbytes)
    except FileExistsError:  # a stale segment of an entry that failed or was dropped mid-write: replace it
        unlink_segment(name)
        shm = _open(name, create=True, size=_DATA_OFFSET + nbytes)
    try:
        shm.buf[: _HEADER.size] = _HEADER.pack(_MAGIC, _DTYPE_CODES[embeds.dtype], embeds.shape[0], embeds.shape[1])
        dst = torch.frombuffer(shm.buf, dtype=embeds.dtype, count=embeds.numel(), offset=_DATA_OFFSET)
        dst.view(embeds.shape).copy_(embeds)  # one copy, device -> shared memory
        del dst
    finally:
        shm.close()


class EmbedReader:
    """The router's side: maps entries as tensor views and keeps each mapping open while a view may be in use."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._open: dict[str, tuple[SharedMemory, int]] = {}  # key -> (segment, users)
        self._closing: list[SharedMemory] = []  # released but a view was still alive; closed later

    def get(self, key: str) -> torch.Tensor:
        """A [num_tokens, hidden] view on the entry's shared memory (no copy). Pair every get with a release."""
        self._close_unused()
        if key in self._open:
            shm, users = self._open[key]
        else:
            shm, users = _open(segment_name(self.prefix, key)), 0
        magic, code, num_tokens, hidden = _HEADER.unpack_from(shm.buf)
        if magic != _MAGIC:
            shm.close()
            raise ValueError(f"shared memory segment for {key} has no embedding header")
        self._open[key] = (shm, users + 1)
        dtype = _DTYPES[code]
        nbytes = num_tokens * hidden * dtype.itemsize
        # Through numpy, because its array holds a buffer export on the mapping for as long as any tensor made from
        # it lives: closing the segment then fails (BufferError) instead of unmapping memory under a live view.
        # (torch.frombuffer drops the export right away.)
        raw = np.frombuffer(shm.buf, dtype=np.uint8, count=nbytes, offset=_DATA_OFFSET)
        return torch.from_numpy(raw).view(dtype).view(num_tokens, hidden)

    def release(self, key: str) -> None:
        """Drop one use of `key`; the mapping closes once the last tensor made from it is gone (checked again on
        every later get/release)."""
        shm, users = self._open[key]
        if users > 1:
            self._open[key] = (shm, users - 1)
            return
        del self._open[key]
        self._closing.append(shm)
        self._close_unused()

    def _close_unused(self) -> None:
        still: list[SharedMemory] = []
        for shm in self._closing:
            try:
                shm.close()
            except BufferError:  # a tensor view still points into it
                still.append(shm)
        self._closing = still

    def close(self) -> None:
        for shm, _ in self._open.values():
            self._closing.append(shm)
        self._open.clear()
        self._close_unused()

    @property
    def num_open(self) -> int:
        return len(self._open) + len(self._closing)
