"""Preprocessed pixels from a pool worker to the visual process through POSIX shared memory.

A result of a `ProcessPoolExecutor` is pickled through a pipe. A torch tensor pickles as a file descriptor handed
over by a per-tensor connection of multiprocessing's resource sharer, a numpy array as its bytes pushed through the
64 KiB pipe: both cost several ms per 336 px image and tens of ms per 896 px image, paid in the visual process's
result thread. Instead the worker writes the pixels into a fresh segment and returns only its name; the visual
process maps it, unlinks the name at once (the mapping stays valid) and uses the mapping as the tensor, which unmaps
when the tensor is freed (after the batch's upload).

The other way, an image file of more than `STAGE_MIN_BYTES` goes to its worker the same way (`SharedBytes`): the
visual process copies it into a spare segment made ahead of time (`visual.spare_segments`: its pages already mapped,
so the copy is a memcpy), the worker copies it out, and the visual process unlinks the segment once the worker is
done. Through the pool's call queue (a pickle through a pipe) a 2.4 MB PNG took ~3.4 ms to reach its worker.

Segment names start with the server's shm prefix, so any that are left behind (a worker or the visual process
killed in between) go with `unlink_all` at the server's stop.
"""

from __future__ import annotations

import _posixshmem
import itertools
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from visual.shm_segments import create_mapped

_counter = itertools.count()
STAGE_MIN_BYTES = 1 << 20  # below this the pipe was as fast (0.3 MB: ~1 ms either way)


@dataclass(frozen=True)
class SharedBytes:
    """An image file the visual process left for a worker: the segment's name and the file's length."""

    name: str
    size: int


def read_bytes(shared: SharedBytes) -> bytes:
    """The file's bytes, copied out of its segment (worker side; the visual process unlinks it)."""
    fd = _posixshmem.shm_open("/" + shared.name, os.O_RDONLY, mode=0o600)
    try:
        with mmap.mmap(fd, shared.size, prot=mmap.PROT_READ) as mapping:
            return mapping[: shared.size]
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SharedPixels:
    """Where a worker left one tensor: the segment's name, and the tensor's shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def share_tensor(tensor: torch.Tensor, prefix: str) -> SharedPixels:
    """Copy `tensor` (CPU) into a new segment (worker side)."""
    src = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # raw bytes: numpy has no bfloat16
    name = f"{prefix}px{os.getpid()}_{next(_counter)}"
    mapping = create_mapped(name, max(src.nbytes, 1))  # OSError(ENOSPC) on a full /dev/shm, not SIGBUS below
    try:
        np.frombuffer(mapping, dtype=np.uint8, count=src.size)[...] = src
    finally:
        del src
    mapping.close()
    return SharedPixels(name, tuple(tensor.shape), tensor.dtype)


def take_tensor(shared: SharedPixels) -> torch.Tensor:
    """Map a worker's segment as a tensor and remove its name (visual-process side; once per segment)."""
    fd = _posixshmem.shm_open("/" + shared.name, os.O_RDWR, mode=0o600)
    try:
        _posixshmem.shm_unlink("/" + shared.name)
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    numel = 1
    for n in shared.shape:
        numel *= n
    # numpy holds the mmap (and so the mapping) for as long as any tensor made from it lives.
    raw = np.frombuffer(mapping, dtype=np.uint8, count=numel * shared.dtype.itemsize)
    return torch.from_numpy(raw).view(shared.dtype).view(shared.shape)


def discard(shared: SharedPixels) -> None:
    """Unlink a segment whose pixels are not wanted (a result dropped at shutdown)."""
    try:
        _posixshmem.shm_unlink("/" + shared.name)
    except FileNotFoundError:
        pass
