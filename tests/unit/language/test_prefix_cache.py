"""The prefix cache: the radix tree on its own (matching, splitting, locking, LRU eviction, image keys), and the
engine with it on a real tiny model, whose greedy tokens must equal the engine's without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from language.prefix_cache import PrefixCache, cache_ids
from language.request import MultimodalItem, PrefixNotCached, Request
from language.sampling_params import SamplingParams
from language.slot_allocator import SlotAllocator
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama


def _running(tree: PrefixCache, ids: list[int]) -> Request:
    """A request that matched `ids` against the tree, then stored the rest in fresh slots (as staging would)."""
    req = Request("r", ids, SamplingParams())
    node, n = tree.match(ids)
    tree.lock(node)
    req.prefix_node, req.cached_len = node, n
    req.kv_slots = tree.path_slots(node) + tree.slots.allocate(len(ids) - n).tolist()
    req.kv_len = len(ids)
    return req


def test_match_splits_edges_and_shares_slots():
    tree = PrefixCache(SlotAllocator(64))
    first = _running(tree, [1, 2, 3, 4, 5])
    tree.release(first, [1, 2, 3, 4, 5], written=5)
    assert tree.total_tokens == 5 and tree.protected_tokens == 0 and tree.slots.num_used == 5
    node, n = tree.match([1, 2, 3, 9])
    assert n == 3 and tree.path_slots(node) == first.kv_slots[:3]  # the edge was cut after 3 ids
    second = _running(tree, [1, 2, 3, 9, 9])
    assert second.cached_len == 3 and tree.protected_tokens == 3 and tree.evictable_tokens == 2
    tree.release(second, [1, 2, 3, 9, 9], written=4)  # its last slot was never written: freed
    assert tree.total_tokens == 6 and tree.slots.num_used == 6 and tree.protected_tokens == 0


def test_release_frees_slots_that_duplicate_what_another_request_inserted():
    tree = PrefixCache(SlotAllocator(64))
    a, b = _running(tree, [7, 8, 9]), _running(tree, [7, 8, 9])  # both missed: neither was in the tree yet
    tree.release(a, [7, 8, 9], 3)
    tree.release(b, [7, 8, 9], 3)
    assert tree.total_tokens == 3 and tree.slots.num_used == 3
    assert tree.path_slots(tree.match([7, 8, 9])[0]) == a.kv_slots


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    tree = PrefixCache(SlotAllocator(12))
    for ids in ([1, 1, 1, 1], [2, 2, 2, 2], [1, 1, 3, 3]):
        tree.release(_running(tree, ids), ids, len(ids))
    assert tree.slots.num_free == 2
    user = _running(tree, [2, 2, 2, 2])  # locks [2, 2, 2, 2]
    tree.make_room(4)  # evicts [1, 1, 1, 1]'s tail first (older than [1, 1, 3, 3]), never the locked path
    assert tree.match([2, 2, 2, 2])[1] == 4 and tree.match([1, 1, 3, 3])[1] == 4 and tree.match([1, 1, 1, 1])[1] == 2
    tree.make_room(12)
    assert tree.total_tokens == 4 == tree.protected_tokens  # only the locked path is left
    tree.release(user, [2, 2, 2, 2], 4)
    tree.clear()
    assert tree.total_tokens == 0 and tree.slots.num_free == 12


def test_image_placeholders_are_keyed_by_the_image():
    embeds = torch.zeros(3, 4)
    prompt = [5, 9, 9, 9, 6]

    def ids(key: str) -> list[int]:
        return cache_ids(Request("r", prompt, SamplingParams(), [MultimodalItem(1, embeds, key)]))

    same, other = ids("a" * 32), ids("b" * 32)
    assert same == ids("a" * 32) and same[0] == 5 and same[4] == 6
    assert all(t < 0 for t in same[1:4]) and len(set(same[1:4])) == 3
    assert same[1:4] != other[1:4]
    assert cache_ids(Request("r", prompt, SamplingParams(), [MultimodalItem(1, embeds, "")])) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(str(tmp_path_factory.mktemp("prefix_llama")))


def test_reused_prefixes_and_answers_give_the_same_tokens(model_dir):
    cached = LLM(model_dir, max_total_token_num=400, device="cpu", chunked_prefill_size=8)
    plain = LLM(model_dir, max_total_token_num=400, device="cpu", prefix_cache=False)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    stem = [3 + (5 * j) % 40 for j in range(21)]
    first = cached.generate([stem + [50, 51]], params)[0].token_ids
    # A follow-up turn: the whole first prompt, its answer, then more; and a sibling question on the same stem.
    prompts = [stem + [50, 51] + first + [60, 61, 62], stem + [70]]
    outs = cached.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert cached.engine.prefix.hit_tokens >= len(stem) + 2 + len(first) - 1 + len(stem)
    assert cached.engine.stats().kv_used == 0


def test_abort_in_flight_keeps_only_written_tokens(model_dir):
    llm = LLM(model_dir, max_total_token_num=200, device="cpu")
    engine = llm.engine
    req = Request("victim", [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.add_request(req)
    for _ in range(4):
        engine.step()
    written = min(req.kv_len, req.seq_len - 1)
    ids = list(req.prompt_ids) + list(req.output_ids)
    engine.abort(req.rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.prefix.total_tokens == written == engine.kv.slots.num_used
    assert engine.prefix.match(ids)[1] == written and engine.stats().kv_used == 0
    assert np.unique(engine.prefix.path_slots(engine.prefix.match(ids)[0])).size == written


def test_an_image_without_embeddings_runs_only_on_a_cached_prefix_that_covers_it(model_dir):
    cached = LLM(model_dir, max_total_token_num=400, device="cpu")
    plain = LLM(model_dir, max_total_token_num=400, device="cpu", prefix_cache=False)
    engine, params = cached.engine, SamplingParams(max_new_tokens=6, ignore_eos=True)
    hidden = engine.model_info.mm_embed_width
    embeds = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(engine.model_info.dtype)
    key, stem = "a" * 32, [5, 9, 9, 9, 6, 7]

    def request(rid: str, tail: list[int], with_embeds: bool, image_key: str = key) -> Request:
        item = MultimodalItem(1, embeds if with_embeds else None, image_key, length=3)
        return Request(rid, stem + tail, params, [item])

    cached.run([request("first", [8], True)])
    follow_up = request("follow-up", [10, 11], False)  # the image's KV is cached: no embeddings needed
    (done,) = cached.run([follow_up])
    (reference,) = plain.run([request("reference", [10, 11], True)])
    assert done.output_ids == reference.output_ids and done.prompt_cache_len >= 5
    assert engine.prefix.protected_tokens == 0

    with pytest.raises(PrefixNotCached):  # another image in the same place: nothing cached covers it
        engine.add_request(request("other", [10], False, image_key="b" * 32))
    assert not engine.has_unfinished() and engine.prefix.protected_tokens == 0

    waiting = request("aborted", [12], False)
    engine.add_request(waiting)  # reserves the covering prefix until admitted...
    assert engine.prefix.protected_tokens >= 5
    engine.abort(waiting.rid)  # ...or removed
    while engine.has_unfinished():
        engine.step()
    assert engine.prefix.protected_tokens == 0 and engine.stats().kv_used == 0
