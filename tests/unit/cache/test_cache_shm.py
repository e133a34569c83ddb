import multiprocessing as mp
import os
import signal

import pytest
import torch

from cache.shm_store import list_segments, new_prefix, read_embedding, unlink_all, unlink_segment, write_embedding


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_then_read_view(prefix, dtype):
    embeds = torch.randn(7, 5).to(dtype)
    write_embedding(prefix, "k", embeds)
    view = read_embedding(prefix, "k")
    assert view.dtype == dtype and view.shape == (7, 5)
    assert torch.equal(view, embeds)


def test_view_shares_the_segment_and_outlives_unlink(prefix):
    """The router may still hold a view when the owner evicts: the mapping stays valid until the view is gone."""
    embeds = torch.arange(12, dtype=torch.float32).view(3, 4)
    write_embedding(prefix, "k", embeds)
    first = read_embedding(prefix, "k")
    second = read_embedding(prefix, "k")
    first[0, 0] = 42.0  # one memory, no copies
    assert second[0, 0] == 42.0
    tail = second[1:]  # a derived view keeps the mapping alive too
    del first, second
    assert unlink_segment(prefix + "k")
    assert not unlink_segment(prefix + "k")
    assert list_segments(prefix) == []
    assert torch.equal(tail, embeds[1:])


def test_rewrite_replaces_a_stale_segment(prefix):
    write_embedding(prefix, "k", torch.zeros(2, 2))
    write_embedding(prefix, "k", torch.ones(3, 2))
    assert torch.equal(read_embedding(prefix, "k"), torch.ones(3, 2))


def test_missing_segment(prefix):
    with pytest.raises(FileNotFoundError):
        read_embedding(prefix, "nope")


def _write_then_die(prefix: str) -> None:
    for i in range(3):
        write_embedding(prefix, f"k{i}", torch.ones(4, 4))
    os.kill(os.getpid(), signal.SIGKILL)


def test_unlink_all_after_a_child_crashed(prefix):
    other = new_prefix()
    write_embedding(other, "mine", torch.ones(1, 1))
    child = mp.get_context("spawn").Process(target=_write_then_die, args=(prefix,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert len(list_segments(prefix)) == 3  # the crash left them behind...
    assert unlink_all(prefix) == 3  # ...and the parent removes them by prefix
    assert list_segments(prefix) == []
    assert list_segments(other) == [other + "mine"]  # another server's segments are untouched
    unlink_all(other)
