"""Embeddings in POSIX shared memory, one segment per cache entry, named `<prefix><key>`.

The implementation lives in `visual.shm_segments` (the visual process writes the segments, and `visual` sits below
`cache` in the import flow); the cache and the server use it through this module.

Every segment a server makes (embeddings, and the preprocessing pool's pixel segments) starts with its prefix,
`mmsv_<pid of the server>_<random>_`, so after a crash (SIGKILL, the OOM killer) the next server start can tell
whose they were: `remove_dead_segments` unlinks those whose server pid is no longer running, and never touches a
live server's. (A pid reused by another process keeps its dead server's segments until that process ends: the
check errs towards keeping. Servers in other pid namespaces that share this /dev/shm, e.g. containers run with
`--ipc=host`, would look dead: do not share /dev/shm across pid namespaces.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from visual.pids import dead_owners_entries
from visual.shm_segments import (
    list_segments,
    new_prefix,
    read_embedding,
    segment_name,
    unlink_all,
    unlink_segment,
    write_embedding,
)

__all__ = [
    "list_segments",
    "new_prefix",
    "read_embedding",
    "ShmEmbedReader",
    "remove_dead_segments",
    "segment_name",
    "unlink_all",
    "unlink_segment",
    "write_embedding",
]

_SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory
_OWNER = re.compile(r"mmsv_(\d+)_")  # the start of every name new_prefix() makes


def remove_dead_segments() -> list[str]:
    """Unlink the segments of mmserve servers that are no longer running (named by new_prefix() with a pid that is
    not alive); returns their names. Segments of live servers, other users' and anything not ours stay."""
    removed = []
    for name in dead_owners_entries(_SHM_DIR, _OWNER):
        try:
            if unlink_segment(name):
                removed.append(name)
        except PermissionError:  # another user's segment in a sticky /dev/shm
            pass
    return removed


@dataclass(frozen=True)
class ShmEmbedReader:
    """The router's EmbedReader (picklable, so it can be handed to the spawned router process): an image's
    embeddings [num_tokens, hidden] by cache key, a view on shared memory."""

    shm_prefix: str

    def __call__(self, ref):  # ref: mmserve.ipc.messages.ImageRef (cache sits below mmserve in the import flow)
        return read_embedding(self.shm_prefix, ref.key)
