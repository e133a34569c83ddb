"""The slot allocator and KV cache: no slot handed out twice, exact free count, contiguous when possible."""

import random

import numpy as np
import pytest
import torch

from language.kv_cache import KVCache
from language.slot_allocator import OutOfSlots, SlotAllocator


def test_random_alloc_free_never_double_allocates():
    rng = random.Random(0)
    alloc = SlotAllocator(997)
    held: list = []
    owned = torch.zeros(997, dtype=torch.bool)
    for _ in range(3000):
        if held and rng.random() < 0.45:
            slots = held.pop(rng.randrange(len(held)))
            alloc.free(slots)
            owned[slots] = False
        else:
            n = rng.choice([1, 1, 2, 7, 31, 120])
            if not alloc.can_allocate(n):
                with pytest.raises(OutOfSlots):
                    alloc.allocate(n)
                continue
            slots = alloc.allocate(n)
            assert slots.size == n and np.unique(slots).size == n
            assert not owned[slots].any(), "a slot was handed out twice"
            owned[slots] = True
            held.append(slots)
        assert alloc.num_free == int((~owned).sum())
        assert alloc.num_used == int(owned.sum())


def test_fresh_allocator_hands_out_ascending_runs_and_reuses_freed_slots():
    alloc = SlotAllocator(16)
    a = alloc.allocate(4)
    b = alloc.allocate(4)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6, 7]
    alloc.free(a)
    c = alloc.allocate(6)  # the freed slots first, then fresh ones
    assert sorted(c.tolist()) == [0, 1, 2, 3, 8, 9]
    assert alloc.num_free == 6 and alloc.num_used == 10


def test_out_of_slots_changes_nothing_and_double_free_is_refused():
    alloc = SlotAllocator(8)
    s = alloc.allocate(6)
    with pytest.raises(OutOfSlots):
        alloc.allocate(3)
    assert alloc.num_free == 2
    alloc.free(s[:2])
    with pytest.raises(ValueError):
        alloc.free(s[:1])
    assert alloc.num_free == 4


def test_kv_cache_rows_free_their_slots():
    kv = KVCache(
        num_layers=1,
        num_slots=32,
        num_kv_heads=1,
        head_dim=4,
        max_requests=3,
        max_req_len=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    rows = [kv.allocate_row() for _ in range(3)]
    assert kv.num_free_rows() == 0
    held = {}
    for row, n in zip(rows, (5, 9, 2), strict=True):
        held[row] = kv.slots.allocate(n)
        kv.assign(torch.full((n,), row), torch.arange(n), torch.from_numpy(held[row]))
        assert kv.req_to_token[row, :n].tolist() == held[row].tolist()
    assert kv.slots.num_used == 16
    kv.free_row(rows[1], held[rows[1]].tolist())
    assert kv.slots.num_used == 7 and kv.num_free_rows() == 1
    kv.free_row(rows[0], held[rows[0]].tolist())
    kv.free_row(rows[2], held[rows[2]].tolist())
    assert kv.slots.num_used == 0 and kv.num_free_rows() == 3
