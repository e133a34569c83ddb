"""The prefix cache: a radix tree over token ids whose nodes hold the KV slots of those tokens.

Every prompt that has run, and every answer generated after it, stays in the tree until its slots are needed. A new
request walks the tree with its own ids, points the first rows of its slot table at the slots found, and prefills
only the rest (TokenAttention makes the reuse token-granular).

Image placeholders are keyed by the image, not by their token ids: `cache_ids` swaps each image's run of placeholder
tokens for negative "virtual" ids derived from its embedding-cache key, so two different images never share KV and
the same image in the same place always does.

Ownership of slots. A slot is free (in the allocator), owned by one running request, or owned by the tree. A running
request owns its slots past `cached_len`; the first `cached_len` belong to the tree, on a path that the request
locks (`ref` > 0 on every node of it), so they are never evicted under it. Unlocked tree slots are evictable, least
recently used leaves first, and count as free for admission.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np
import xxhash

from language.request import Request
from language.slot_allocator import SlotAllocator

_VIRTUAL_SPAN = 1 << 62  # virtual ids are -1 - (h + i) with h < 2**62: negative, never a vocabulary id


def cache_ids(req: Request) -> list[int] | None:
    """The prompt as the tree keys it: image placeholder runs replaced by ids derived from the image's cache key
    (and its patch grid). None if an image has no key: its KV must not be shared."""
    if not req.mm_items:
        return req.prompt_ids
    ids = list(req.prompt_ids)
    for item in req.mm_items:
        if not item.key:
            return None
        h = xxhash.xxh3_64_intdigest(f"{item.key}|{item.grid_thw}|{item.row_start}".encode()) % _VIRTUAL_SPAN
        ids[item.offset : item.offset + item.num_tokens] = range(-1 - h, -1 - h - item.num_tokens, -1)
    return ids


class Node:
    __slots__ = ("key", "slots", "children", "parent", "ref", "last_use")

    def __init__(self, key: list[int], slots: np.ndarray, parent: Node | None):
        self.key = key  # the token ids of this edge
        self.slots = slots  # int64 [len(key)]: their KV slots
        self.children: dict[int, Node] = {}  # first id of the child's key -> child
        self.parent = parent
        self.ref = 0  # running requests whose cached prefix passes through this node
        self.last_use = 0


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])


class PrefixCache:
    def __init__(self, slots: SlotAllocator):
        self.slots = slots
        self.root = Node([], np.empty(0, dtype=np.int64), None)
        self.root.ref = 1  # never evicted
        self.total_tokens = 0  # slots the tree owns
        self.protected_tokens = 0  # of those, the ones on a path some running request locks
        self.hit_tokens = 0  # prompt tokens whose KV came from the tree, since start
        self._clock = itertools.count(1)

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.protected_tokens

    # ---- lookup ----
    def match(self, ids: Sequence[int]) -> tuple[Node, int]:
        """The deepest node whose path is a prefix of `ids`, and that path's length. A match that ends inside an
        edge splits it there, so the returned node covers exactly the matched tokens."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids[pos : pos + len(child.key)])
            if n < len(child.key):
                return self._split(child, n), pos + n
            node, pos = child, pos + n
        return node, pos

    def path_slots(self, node: Node) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.slots)
            node = node.parent
        return np.concatenate(parts[::-1]).tolist() if parts else []

    def unprotected_tokens(self, node: Node) -> int:
        """Tokens on the path to `node` that no running request locks (locking it would protect them)."""
        n = 0
        while node.ref == 0:
            n += len(node.key)
            node = node.parent
        return n

    # ---- the requests' side ----
    def lock(self, node: Node) -> None:
        stamp = next(self._clock)
        while node is not self.root:
            if node.ref == 0:
                self.protected_tokens += len(node.key)
            node.ref += 1
            node.last_use = stamp
            node = node.parent

    def unlock(self, node: Node) -> None:
        stamp = next(self._clock)
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.protected_tokens -= len(node.key)
            node.last_use = stamp
            node = node.parent

    def adopt(self, req: Request, ids: Sequence[int], length: int) -> None:
        """Hand the request's first `length` tokens (ids[:length], KV written by launched steps) to the tree while it
        keeps running: afterwards it locks their path and `cached_len` == `length`. Skipped when another request
        already put part of them in the tree since this one matched: both then hold equal KV in different slots,
        and this request keeps its own until it finishes."""
        node, matched = self.match(ids[:length])
        if node is not req.prefix_node or matched >= length:
            return
        leaf = self._add_child(node, list(ids[matched:length]), np.asarray(req.kv_slots[matched:length], np.int64))
        self.lock(leaf)
        self.unlock(node)
        req.prefix_node, req.cached_len = leaf, length

    def release(self, req: Request, ids: Sequence[int], written: int) -> None:
        """A finished request: its first `written` tokens (ids[:written], KV written by launched steps) go into the
        tree, its other slots (never written, or equal to what another request put in the tree meanwhile) back to
        the allocator, and its lock is dropped."""
        cached, slots = req.cached_len, req.kv_slots
        free = slots[cached:]
        if written > cached:
            node, matched = self.match(ids[:written])  # passes through the locked path: matched >= cached
            if matched < written:
                self._add_child(node, list(ids[matched:written]), np.asarray(slots[matched:written], np.int64))
            free = slots[cached:matched] + slots[written:]
        self.unlock(req.prefix_node)
        self.slots.free(free)
        req.prefix_node, req.cached_len = None, 0

    # ---- memory ----
    def make_room(self, needed: int) -> None:
        """Evict least recently used unlocked leaves until `needed` slots are free (or nothing is evictable)."""
        short = needed - self.slots.num_free
        if short <= 0:
            return
        leaves = [n for n in self._nodes() if not n.children and n.ref == 0]
        heap = [(n.last_use, id(n), n) for n in leaves]
        heapq.heapify(heap)
        while short > 0 and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove_leaf(node)
            short -= len(node.key)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))

    def clear(self) -> None:
        """Evict everything no running request uses."""
        self.make_room(self.slots.num_slots)

    # ---- tree edits ----
    def _add_child(self, parent: Node, key: list[int], slots: np.ndarray) -> Node:
        child = Node(key, slots, parent)
        child.last_use = next(self._clock)
        parent.children[key[0]] = child
        self.total_tokens += len(key)
        return child

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n ids: a new node with the first n becomes its parent. Returns the new node."""
        parent = child.parent
        head = Node(child.key[:n], child.slots[:n], parent)
        head.ref, head.last_use = child.ref, child.last_use
        head.children[child.key[n]] = child
        parent.children[child.key[0]] = head
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], head
        return head

    def _remove_leaf(self, node: Node) -> None:
        del node.parent.children[node.key[0]]
        self.total_tokens -= len(node.key)
        self.slots.free(node.slots)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
