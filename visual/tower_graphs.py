"""CUDA graphs for small vision-tower batches (`--visual_cuda_graph_max_patches`): a batch whose exact image grids
were seen before replays the graph captured for them instead of launching the tower's kernels one by one.

Why: a small batch is launch-bound. The 7B Qwen2-VL tower is ~400 kernel launches from Python (32 blocks); one 336 px
image took ~25 ms of host time on the H100 host for ~2 ms of GPU work. A replay is one launch.

What a graph is keyed by: the batch's grids, a tuple of (t, h, w) per image, in order. Everything the tower derives
from them (cu_seqlens and max_seqlen, rotary position ids, Qwen2.5-VL's window order, Qwen3-VL's position-table taps)
is a function of that key: it is built once, on the host, when the key is captured, uploaded into device tensors the
graph keeps, and reused by every replay. The pixels are the only input that changes: copied into the graph's static
input buffer before each replay. The output is copied out of the graph's static buffer right after, so a later
replay of any graph (they share one memory pool) cannot overwrite what the caller holds.

When: a key is captured the second time it is seen (a size seen once may never come again), and only for batches of
at most max_patches patches (larger ones are GPU-bound: launches are a small share of their time, and their graphs
would hold much memory). At most `max_graphs` graphs are kept, the least recently replayed dropped first."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

MAX_TOWER_GRAPHS = 8  # graphs kept: a few common image sizes, alone or in pairs
_SEEN_KEYS = 256  # keys remembered as seen once (beyond this, the oldest are forgotten)

Grids = tuple[tuple[int, int, int], ...]
E = TypeVar("E")


class GraphLru(Generic[E]):
    """Which batches get a graph: the keys seen once, and the captured entries, least recently used first."""

    def __init__(self, max_patches: int, max_graphs: int = MAX_TOWER_GRAPHS, max_seen: int = _SEEN_KEYS) -> None:
        if max_graphs < 1:
            raise ValueError("at least one graph must be kept")
        self.max_patches = max_patches
        self.max_graphs = max_graphs
        self.max_seen = max_seen
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._entries: OrderedDict[Hashable, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """The captured keys, least recently used first."""
        return list(self._entries)

    def get(self, key: Hashable) -> E | None:
        """The key's entry (now the most recently used one), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def sighted(self, key: Hashable, patches: int) -> bool:
        """Note that a batch of this key (with no entry) runs now: True when it should be captured, i.e. it is small
        enough and was seen before."""
        if patches > self.max_patches:
            return False
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        return False

    def put(self, key: Hashable, entry: E) -> list[E]:
        """Keep the key's entry as the most recently used; returns the entries dropped to make room."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        dropped = []
        while len(self._entries) > self.max_graphs:
            dropped.append(self._entries.popitem(last=False)[1])
        return dropped


@dataclass
class CapturedTower:
    """One key's graph and the device tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # static input [patches, C*T*P*P]
    inputs: dict  # the key's tower inputs (device tensors and ints), kept alive for the graph
    output: torch.Tensor  # static output [tokens, width]

    def replay(self, pixels: torch.Tensor) -> torch.Tensor:
        self.pixels.copy_(pixels)
        self.graph.replay()
        return self.output.clone()  # out of the shared pool before another graph replays over it


class TowerGraphs:
    """Runs a tower batch eagerly or from its grids' graph. `forward(pixels, inputs)` is the tower (pixels
    [patches, C*T*P*P] -> [tokens, width]); `inputs(grids, device)` builds what it derives from the grids, on the host
    and uploaded without a sync; neither may sync the host (nothing in a capture may)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, dict], torch.Tensor],
        inputs: Callable[[Grids, torch.device], dict],
        max_patches: int,
        max_graphs: int = MAX_TOWER_GRAPHS,
    ) -> None:
        self.forward = forward
        self.inputs = inputs
        self.lru: GraphLru[CapturedTower] = GraphLru(max_patches, max_graphs)
        self._pool = torch.cuda.graph_pool_handle()  # one pool for every capture: they never run at once
        self.disabled = False  # a capture failed: eager from then on
        self.replays = 0
        self.captures = 0

    def run(self, grids: Grids, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's output for a batch of these grids (pixels on the device, in the tower's dtype)."""
        key = tuple(tuple(g) for g in grids)
        entry = self.lru.get(key)
        if entry is not None:
            self.replays += 1
            return entry.replay(pixels)
        if not self.disabled and self.lru.sighted(key, pixels.shape[0]):
            return self._capture(key, pixels)
        return self.forward(pixels, self.inputs(key, pixels.device))

    def _capture(self, key: Grids, pixels: torch.Tensor) -> torch.Tensor:
        """Capture the key's graph; returns this batch's output, from an eager run just before the capture (which
        also loads any kernel the capture would otherwise compile inside it)."""
        start = time.perf_counter()
        inputs = self.inputs(key, pixels.device)
        out = self.forward(pixels, inputs)
        static = pixels.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self.forward(static, inputs)
        except Exception:
            logger.exception("vision tower: capturing a CUDA graph failed; the tower runs eagerly from now on")
            self.disabled = True
            return out
        self.captures += 1
        self.lru.put(key, CapturedTower(graph, static, inputs, output))  # a dropped graph's memory returns to the pool
        logger.info("vision tower: CUDA graph captured for %d image(s), %d patches, in %.0f ms (%d kept)",
                    len(key), pixels.shape[0], (time.perf_counter() - start) * 1e3, len(self.lru))  # fmt: skip
        return out
