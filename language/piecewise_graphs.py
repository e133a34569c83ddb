"""Piecewise CUDA graphs for prompt and mixed steps: everything of the step's forward that is dense over its rows
(norms, projections, rotary, the KV store, the MLP) replayed from graphs captured per token count, with only the
attention launched eagerly between them, since it depends on the step's sequences.

Why: an eager step of the 7B decoder is ~300 launches, 30-60 ms of host on the GPU host whatever its size (py-spy:
Triton's launcher, cuBLAS dispatch and our argument checks), so a step of a few hundred prompt tokens leaves the
GPU waiting, and requests that arrive meanwhile wait for the next step. Replayed, a layer costs one graph and its
attention launches. vLLM's and SGLang's piecewise graphs split the forward the same way.

Layer i's graph runs layer i-1's end (o_proj, residual add and norm, MLP) and layer i's start (residual add and
norm, q/k/v, rotary, KV store); graph 0 starts at the embeddings, graph L ends the last layer. Between graph i and
i+1, layer i's attention reads `q` and writes `attn`. All of them read and write the static buffers here, so the
graphs share one memory pool for their intermediates and may replay in any order. A step of n tokens replays the
graphs of the next captured size N >= n: its rows n..N compute on stale values that no real row reads (every op
in a graph is row-wise or a GEMM over rows), and they store their K/V in the cache's dummy slot."""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable

import torch

from language.forward_batch import ForwardBatch
from language.kernels.precompile import compile_only
from language.kv_cache import KVCache
from language.progress import progress

logger = logging.getLogger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Multiples of 16 to 128, then four steps per doubling (160, 192, 224, 256, 320, ...), up to max_tokens
    rounded up to 16: a step pads by less than a quarter of its tokens."""
    cap = -(-max_tokens // 16) * 16
    sizes, step = list(range(16, 129, 16)), 32
    while sizes[-1] < cap:
        sizes += [sizes[-1] + step * i for i in range(1, 5)]
        step *= 2
    return [s for s in sizes if s < cap] + [cap]


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device, max_tokens: int):
        self.model, self.kv = model, kv
        self.layers = list(model.layers)
        self.sizes = piecewise_sizes(max_tokens)
        n, cfg = self.sizes[-1], model.cfg
        attn = self.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        # The static buffers every graph reads and writes (zeroed: padded rows start from finite values).
        self.x = torch.zeros((n, cfg.hidden_size), dtype=dtype, device=device)  # [N, hidden]
        self.residual = torch.zeros_like(self.x)  # [N, hidden]
        self.q = torch.zeros((n, attn.num_heads, attn.head_dim), dtype=dtype, device=device)  # [N, Hq, D]
        self.attn = torch.zeros_like(self.q)  # [N, Hq, D]: the attention's output
        positions = torch.zeros((model.position_dims, n), dtype=torch.int64, device=device).squeeze(0)
        self.cos, self.sin = (t.clone() for t in model.rotary(positions))  # [N, D/2] each
        self.slots = torch.full((n,), kv.dummy_slot, dtype=torch.int64, device=device)  # [N]
        # Per size, what runs piece i: its graph's replay; on CPU (tests) the piece itself, nothing captured.
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        if device.type == "cuda":
            self._capture_all()
        else:
            self.pieces = {s: [functools.partial(self._piece, i, s) for i in range(len(self.layers) + 1)]
                           for s in self.sizes}  # fmt: skip

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.fits(batch.input_ids.shape[0]) and self.model.layers_only(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward over the batch (as `model(batch)`) -> logits [num_seqs (+ scored), vocab]."""
        n = batch.input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        x, cos, sin = self.model.embed(batch)
        self.x[:n], self.cos[:n], self.sin[:n], self.slots[:n] = x, cos, sin, batch.out_slots
        if n < size:
            self.slots[n:size] = self.kv.dummy_slot  # a longer step's slots must not be written again
        q, attn = self.q[:n], self.attn[:n]
        for i, run_piece in enumerate(self.pieces[size]):
            run_piece()
            if i < len(self.layers):
                self.layers[i].self_attn.attend(q, batch, out=attn)
        return self.model.logits(self.x[:n], self.residual[:n], batch)

    def _piece(self, i: int, n: int) -> None:
        """Graph i's work over the first n rows of the static buffers."""
        if i == 0:
            x, residual = self.x[:n], None
        else:
            x, residual = self.layers[i - 1].after_attention(self.attn[:n], self.residual[:n])
        if i < len(self.layers):
            _, residual = self.layers[i].before_attention(
                x, residual, self.cos[:n], self.sin[:n], self.slots[:n], self.kv, q_out=self.q[:n]
            )
        else:
            self.x[:n] = x
        self.residual[:n] = residual

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pieces = range(len(self.layers) + 1)
        with compile_only("piecewise graphs"):  # every size's kernel variants at once; nothing runs
            for size in self.sizes:
                for i in pieces:
                    self._piece(i, size)
        pool = None
        sizes = list(reversed(self.sizes))  # largest first: the others fit in the memory its pieces freed
        for size in progress(sizes, len(sizes), "capturing piecewise graphs", logger):
            for i in pieces:  # warm-up outside the capture (cuBLAS picks and caches its kernels)
                self._piece(i, size)
            torch.cuda.synchronize()
            graphs = []
            for i in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, size)
                pool = graph.pool()
                graphs.append(graph)
            self.pieces[size] = [graph.replay for graph in graphs]
        self.slots.fill_(self.kv.dummy_slot)  # the captures' runs wrote nothing live: all slots were dummy
        torch.cuda.synchronize()
