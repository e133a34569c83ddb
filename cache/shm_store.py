"""Embeddings in POSIX shared memory, one segment per cache entry, named `<prefix><key>`.

The implementation lives in `visual.shm_segments` (the visual process writes the segments, and `visual` sits below
`cache` in the import flow); the cache and the server use it through this module.
"""

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
    "segment_name",
    "unlink_all",
    "unlink_segment",
    "write_embedding",
]
