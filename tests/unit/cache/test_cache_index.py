import pytest

from cache.index import CacheBusy, CacheCapacityError, EmbedCacheIndex, EntryState
from cache.key import cache_key


def _ready(index, keys):
    entries, new = index.acquire(keys)
    for key in new:
        index.mark_ready(key, 4)
    return entries, new


def test_key_depends_on_bytes_and_salt():
    assert cache_key(b"abc", "m1") == cache_key(b"abc", "m1")
    assert cache_key(b"abc", "m1") != cache_key(b"abd", "m1")
    assert cache_key(b"abc", "m1") != cache_key(b"abc", "m2")
    assert len(cache_key(b"", "")) == 32


def test_refcount_and_new_keys():
    index = EmbedCacheIndex(4)
    entries, new = index.acquire(["a", "b", "a"])
    assert new == ["a", "b"]
    assert [e.key for e in entries] == ["a", "b", "a"]
    assert index.lookup("a").refs == 2 and index.lookup("b").refs == 1
    assert index.lookup("a").state is EntryState.PENDING
    entries2, new2 = index.acquire(["a"])
    assert new2 == [] and index.lookup("a").refs == 3  # pending key: waits on the same encode
    assert index.stats.hits == 1 and index.stats.misses == 2
    index.release(entries + entries2)
    assert index.lookup("a").refs == 0 and index.lookup("b").refs == 0
    with pytest.raises(RuntimeError):
        index.release(entries2)


def test_lru_eviction_of_unreferenced_ready_entries():
    evicted = []
    index = EmbedCacheIndex(3, on_evict=evicted.append)
    for key in ["a", "b", "c"]:
        entries, _ = _ready(index, [key])
        index.release(entries)
    touched, _ = index.acquire(["a"])  # a becomes most recently used
    index.release(touched)
    entries, new = _ready(index, ["d", "e"])
    assert new == ["d", "e"]
    assert evicted == ["b", "c"]
    assert sorted(k for k in ["a", "b", "c", "d", "e"] if index.lookup(k)) == ["a", "d", "e"]
    assert len(index) == 3


def test_referenced_and_pending_entries_are_never_evicted():
    index = EmbedCacheIndex(2)
    held, _ = _ready(index, ["a"])
    pending, _ = index.acquire(["b"])
    index.release(pending)  # b unreferenced but still encoding
    with pytest.raises(CacheBusy):
        index.acquire(["c"])
    assert len(index) == 2 and index.lookup("c") is None  # all or nothing
    index.mark_ready("b", 4)
    entries, new = index.acquire(["c"])
    assert new == ["c"] and index.lookup("b") is None and index.lookup("a") is not None
    index.release(held + entries)


def test_more_images_than_capacity_is_an_error():
    index = EmbedCacheIndex(2)
    with pytest.raises(CacheCapacityError, match="at most 2"):
        index.acquire(["a", "b", "c"])
    entries, _ = index.acquire(["a", "b", "a", "b"])  # duplicates are one entry each
    assert len(index) == 2
    index.release(entries)


def test_failed_entry_is_dropped_and_retried():
    index = EmbedCacheIndex(2)
    first, _ = index.acquire(["a"])
    second, _ = index.acquire(["a"])
    index.mark_failed("a")
    assert index.lookup("a") is None
    index.release(first + second)  # no-op on a dropped entry
    again, new = index.acquire(["a"])
    assert new == ["a"] and again[0].refs == 1
