"""Pixels from a pool worker through shared memory: same values back, and no segment left behind."""

import torch

from cache.shm_store import list_segments, new_prefix
from visual.shared_pixels import discard, share_tensor, take_tensor


def test_round_trip_leaves_no_segment() -> None:
    prefix = new_prefix()
    src = torch.randn(576, 1176)
    shared = share_tensor(src, prefix)
    assert list_segments(prefix) == [shared.name]
    out = take_tensor(shared)
    assert list_segments(prefix) == []  # unlinked at once; the mapping lives on in `out`
    assert torch.equal(out, src) and out.dtype == src.dtype


def test_discard_removes_an_uncollected_segment() -> None:
    prefix = new_prefix()
    shared = share_tensor(torch.ones(4, 8, dtype=torch.bfloat16), prefix)
    discard(shared)
    discard(shared)  # twice is harmless
    assert list_segments(prefix) == []
