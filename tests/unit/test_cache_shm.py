import multiprocessing as mp
import os
import signal

import pytest
import torch

from cache.shm_store import EmbedReader, list_segments, new_prefix, unlink_all, unlink_segment, write_embedding


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_then_read_view(prefix, dtype):
    embeds = torch.randn(7, 5).to(dtype)
    write_embedding(prefix, "k", embeds)
    reader = EmbedReader(prefix)
    view = reader.get("k")
    assert view.dtype == dtype and view.shape == (7, 5)
    assert torch.equal(view, embeds)
    reader.release("k")
    del view
    reader.close()
    assert reader.num_open == 0


def test_view_outlives_release_and_unlink(prefix):
    """The router may still hold a view when the owner evicts: the mapping stays valid until the view is gone."""
    embeds = torch.arange(12, dtype=torch.float32).view(3, 4)
    write_embedding(prefix, "k", embeds)
    reader = EmbedReader(prefix)
    view = reader.get("k")[1:]  # a derived view keeps the mapping alive too
    reader.release("k")
    assert unlink_segment(prefix + "k")
    assert list_segments(prefix) == []
    assert reader.num_open == 1
    assert torch.equal(view, embeds[1:])
    del view
    reader.close()
    assert reader.num_open == 0


def test_rewrite_replaces_a_stale_segment(prefix):
    write_embedding(prefix, "k", torch.zeros(2, 2))
    write_embedding(prefix, "k", torch.ones(3, 2))
    reader = EmbedReader(prefix)
    assert torch.equal(reader.get("k"), torch.ones(3, 2))
    reader.release("k")


def test_missing_segment(prefix):
    with pytest.raises(FileNotFoundError):
        EmbedReader(prefix).get("nope")


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
