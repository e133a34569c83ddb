"""Embeddings in POSIX shared memory, one segment per cache entry, named `<prefix><key>`.

A segment is a 64-byte header (magic, dtype, shape) followed by the raw [num_tokens, hidden] tensor, so a reader
needs only the key. The visual process writes segments (`create_mapped`, or a spare made ahead and renamed:
`visual.spare_segments`), the router maps them as tensor views (no copy), the index owner unlinks evicted ones,
and the server's parent unlinks every segment with its prefix at stop (the names are all it needs, so this works
after a child crashed). Reading and unlinking go through `_posixshmem`, the module SharedMemory itself is built on,
because a SharedMemory object insists on closing its mapping itself, while here a tensor outlives it.

A new segment's pages are allocated when it is created (`reserve`), not when first written: on a full /dev/shm
(a container's 64 MB default) ftruncate succeeds anyway, and the first write to a page the tmpfs cannot supply kills
the writer with SIGBUS. Allocated up front, a full /dev/shm is an OSError(ENOSPC) the caller reports.
"""

from __future__ import annotations

import _posixshmem
import errno
import mmap
import os
import secrets
import struct
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
# torch is imported where a tensor is made: the server's parent names and sweeps segments before it imports torch
# (its children start sooner).

_HEADER = struct.Struct("<4sB3xQQ")  # magic, dtype code, num_tokens, hidden
_DATA_OFFSET = 64
_MAGIC = b"MMEC"
_DTYPES = {1: "float16", 2: "bfloat16", 3: "float32"}  # torch dtype names by header code
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory (for unlink_all)


def new_prefix() -> str:
    """A per-server prefix, unique on the host: every segment of this server starts with it."""
    return f"mmsv_{os.getpid()}_{secrets.token_hex(4)}_"


def segment_name(prefix: str, key: str) -> str:
    return prefix + key


def open_segment(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    """Open a segment whose lifetime we manage ourselves: Python < 3.13 registers every open with the resource
    tracker, which would unlink it when the opening process exits (and warn), so unregister right away."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, create=create, size=size, track=False)
    shm = SharedMemory(name=name, create=create, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the registered name has its "/"
    return shm


def reserve(fd: int, size: int) -> None:
    """Size a new segment and allocate all its pages now; OSError(ENOSPC), naming /dev/shm, if there is no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        message = f"no room in {_SHM_DIR} for a {size}-byte shared-memory segment (it is full)"
        raise OSError(errno.ENOSPC, message) from None


def create_mapped(name: str, size: int, populate: bool = False) -> mmap.mmap:
    """A new segment of `size` bytes (allocated: see `reserve`), mapped; the name is removed again on any error.
    populate: its pages mapped now (MAP_POPULATE), so that writing them takes no page faults."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        reserve(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (mappings that exist stay valid until closed). False if it did not exist."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def publish_segment(name: str, new_name: str, size: int) -> None:
    """Cut segment `name` to `size` bytes (its pages past that are freed) and rename it `new_name`, replacing any
    segment of that name (mappings of the replaced one stay valid until closed): readers that open `new_name`
    find it whole, never half-written."""
    os.truncate(os.path.join(_SHM_DIR, name), size)
    os.rename(os.path.join(_SHM_DIR, name), os.path.join(_SHM_DIR, new_name))


def free_bytes() -> int:
    """Room left in /dev/shm."""
    st = os.statvfs(_SHM_DIR)
    return st.f_bavail * st.f_frsize


def list_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix)) if os.path.isdir(_SHM_DIR) else []


def unlink_all(prefix: str) -> int:
    """Unlink every segment of one server (at stop, also after a child crashed); returns how many."""
    return sum(unlink_segment(name) for name in list_segments(prefix))


def embedding_nbytes(embeds: torch.Tensor) -> int:
    """The size of `embeds`' segment (header + data); ValueError for a tensor a segment cannot hold."""
    if embeds.dim() != 2 or _dtype_code(embeds) is None:
        raise ValueError(f"expected a 2-D float16/bfloat16/float32 tensor, got {embeds.dtype} {tuple(embeds.shape)}")
    return _DATA_OFFSET + embeds.numel() * embeds.element_size()


def fill_embedding(mapping: mmap.mmap, embeds: torch.Tensor) -> None:
    """Write the header and `embeds` [num_tokens, hidden] (any device) into a mapped segment of at least
    `embedding_nbytes(embeds)` bytes."""
    import torch

    buf = memoryview(mapping)
    try:
        buf[: _HEADER.size] = _HEADER.pack(_MAGIC, _dtype_code(embeds), embeds.shape[0], embeds.shape[1])
        dst = torch.frombuffer(buf, dtype=embeds.dtype, count=embeds.numel(), offset=_DATA_OFFSET)
        dst.view(embeds.shape).copy_(embeds)  # one copy, device -> shared memory
        del dst
    finally:
        buf.release()


def write_embedding(prefix: str, key: str, embeds: torch.Tensor) -> None:
    """Write `embeds` [num_tokens, hidden] (any device) into a new segment for `key`."""
    name = segment_name(prefix, key)
    nbytes = embedding_nbytes(embeds)
    try:
        mapping = create_mapped(name, nbytes)
    except FileExistsError:  # a stale segment of an entry that failed or was dropped mid-write: replace it
        unlink_segment(name)
        mapping = create_mapped(name, nbytes)
    try:
        fill_embedding(mapping, embeds)
    finally:
        mapping.close()


def _dtype_code(embeds: torch.Tensor) -> int | None:
    return _DTYPE_CODES.get(str(embeds.dtype).removeprefix("torch."))


def read_embedding(prefix: str, key: str) -> torch.Tensor:
    """The router's side: a [num_tokens, hidden] tensor viewing the entry's shared memory (no copy). The tensor owns
    the mapping: it stays valid after the owner unlinks the entry, and is unmapped when the last tensor made from it
    is freed, so the caller has nothing to release."""
    import torch

    name = segment_name(prefix, key)
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    magic, code, num_tokens, hidden = _HEADER.unpack_from(mapping)
    if magic != _MAGIC:
        mapping.close()
        raise ValueError(f"shared memory segment {name} holds no embeddings")
    dtype = getattr(torch, _DTYPES[code])
    # numpy keeps the mmap object alive (and mapped) for as long as any tensor made from this array lives;
    # torch.frombuffer would not (it keeps no reference to the buffer's owner).
    raw = np.frombuffer(mapping, dtype=np.uint8, count=num_tokens * hidden * dtype.itemsize, offset=_DATA_OFFSET)
    return torch.from_numpy(raw).view(dtype).view(num_tokens, hidden)
