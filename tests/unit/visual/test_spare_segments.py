"""Spare embedding segments (visual/spare_segments.py): a write takes a spare made ahead of time and renames it to the
entry's name, exactly sized; the refill thread makes new ones; nothing of them outlives `close` or a restart."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cache.shm_store import list_segments, new_prefix, read_embedding, unlink_all
from visual.spare_segments import SpareSegments

SHAPE = (300, 64)  # 76.8 KB of float32: a spare of 1 MiB


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


def spares_of(prefix: str) -> list[str]:
    return list_segments(prefix + "spare")


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_writes_after_the_first_take_spares_made_ahead(prefix):
    segments = SpareSegments(prefix, count=2)
    first = torch.randn(SHAPE)
    segments.write("k0", first)  # nothing is known of the sizes yet: a new segment, and spares for next time
    assert segments.taken == 0
    wait_for(lambda: len(spares_of(prefix)) == 2)

    second, small = torch.randn(SHAPE), torch.randn(7, 64).to(torch.bfloat16)
    segments.write("k1", second)
    segments.write("k2", small)
    assert segments.taken == 2
    for key, expected in (("k0", first), ("k1", second), ("k2", small)):
        got = read_embedding(prefix, key)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    # cut to the entry's size: a spare's unused room does not stay with the cache
    assert os.stat(f"/dev/shm/{prefix}k2").st_size == 64 + 7 * 64 * 2
    wait_for(lambda: len(spares_of(prefix)) == 2)  # refilled

    segments.close()
    assert spares_of(prefix) == []
    assert sorted(list_segments(prefix)) == [prefix + k for k in ("k0", "k1", "k2")]  # the entries stay


def test_a_spare_replaces_a_stale_segment_of_the_same_key(prefix):
    segments = SpareSegments(prefix, count=1)
    segments.expect([torch.zeros(SHAPE)])
    wait_for(lambda: len(spares_of(prefix)) == 1)
    segments.write("k", torch.ones(SHAPE))  # the spare's size was known: taken
    wait_for(lambda: len(spares_of(prefix)) == 1)
    old = read_embedding(prefix, "k")  # a reader that mapped it keeps its bytes
    segments.write("k", torch.full(SHAPE, 2.0))
    assert segments.taken == 2
    assert torch.equal(read_embedding(prefix, "k"), torch.full(SHAPE, 2.0))
    assert torch.equal(old, torch.ones(SHAPE))
    segments.close()


def test_a_larger_entry_than_the_spares_makes_larger_spares(prefix):
    segments = SpareSegments(prefix, count=1)
    segments.expect([torch.zeros(SHAPE)])
    wait_for(lambda: len(spares_of(prefix)) == 1)
    large = torch.randn(5000, 64)  # 1.28 MB: more than the 1 MiB spare
    segments.write("big", large)
    assert segments.taken == 0
    wait_for(lambda: [os.stat(f"/dev/shm/{n}").st_size for n in spares_of(prefix)] == [2 << 20])
    segments.write("big2", large)
    assert segments.taken == 1 and torch.equal(read_embedding(prefix, "big2"), large)
    segments.close()


def test_a_restarted_writer_removes_the_spares_of_the_one_before(prefix):
    dead = SpareSegments(prefix, count=2)
    dead.expect([torch.zeros(SHAPE)])
    wait_for(lambda: len(spares_of(prefix)) == 2)  # then the process dies without closing
    SpareSegments(prefix).close()
    assert spares_of(prefix) == []
