"""The tower hands the GPU to the router's prompt steps between its blocks (`--tower_yield_ms`).

The visual process and the router share one GPU from two processes, and the driver time-slices between them: under
a burst of 896 px images each tower batch and each prompt step ran at about half its speed alone, and the LM
prefilled every request at that pace. A request whose images are encoded is nearer its first token than one still
in the tower, so prompt steps go first: before each of the tower's blocks, while the router's flag says a prompt
step runs (`TowerTurn.prefill_running`), the tower lets the blocks it has queued finish and waits, at most
`limit_s` per batch, so that the tower never starves behind an endless stream of prompts.

A flag read on the host says nothing about the GPU if the host is far ahead of it: the tower's launches take a
fraction of its run time, so without a bound the whole batch would be queued before the first block's check. Each
block therefore waits for the block `_LEAD_BLOCKS` before it to finish on the device (a CUDA event), which keeps
the queue short enough for a yield to take effect within a few blocks.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from visual.tower_turn import TowerTurn

logger = logging.getLogger(__name__)

_LEAD_BLOCKS = 2  # blocks the host may have queued ahead of the device


class PrefillYield:
    """Forward pre-hooks on the tower's blocks (`attach`), reset per batch (`start_batch`); visual process only."""

    def __init__(self, turn: TowerTurn, limit_s: float) -> None:
        self.turn = turn
        self.limit_s = limit_s
        self.waited_s = 0.0  # in the current batch
        self._queued: deque[torch.cuda.Event] = deque()  # the ends of the blocks launched, oldest first
        self._hooks: list = []
        self._on_gpu = False

    @classmethod
    def for_model(cls, model: object, turn: TowerTurn, limit_s: float) -> PrefillYield | None:
        """Attached to the vision model's blocks; None (with a warning) for a model without any."""
        blocks = tower_blocks(model)
        if not blocks:
            logger.warning("--tower_yield_ms: %s has no blocks to pause between; the tower never yields",
                           type(model).__name__)  # fmt: skip
            return None
        yielder = cls(turn, limit_s)
        yielder.attach(blocks)
        return yielder

    def attach(self, blocks: torch.nn.Module) -> None:
        self._on_gpu = next(blocks.parameters()).is_cuda
        self._hooks = [block.register_forward_pre_hook(self._before_block) for block in blocks]

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def start_batch(self) -> None:
        self.waited_s = 0.0
        self._queued.clear()

    def _before_block(self, block: torch.nn.Module, args: tuple) -> None:
        if self._on_gpu:
            end_of_previous = torch.cuda.Event()
            end_of_previous.record()
            self._queued.append(end_of_previous)
            if len(self._queued) > _LEAD_BLOCKS:
                self._queued.popleft().synchronize()
        if self.waited_s >= self.limit_s or not self.turn.prefill_running():
            return
        if self._on_gpu:
            torch.cuda.current_stream().synchronize()  # our queued blocks done: the GPU is the prompt step's
            self._queued.clear()
        self.waited_s += self.turn.wait_for_prefill(self.limit_s - self.waited_s)


def tower_blocks(model: object) -> torch.nn.Module | None:
    """The vision model's repeated transformer blocks: the longest `ModuleList` or `Sequential` of composite
    modules of one class (CLIP's encoder layers, the Qwen2-VL family's blocks, timm's blocks in Qwen-VL; an MLP's
    layers are neither of one class nor composite, and Qwen3-VL's DeepStack mergers come after its blocks and are
    fewer). None when it has none."""
    roots = [model] if isinstance(model, torch.nn.Module) else list(vars(model).values())
    candidates = [
        m
        for root in roots
        if isinstance(root, torch.nn.Module)
        for m in root.modules()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and _repeated_blocks(m)
    ]
    return max(candidates, key=len, default=None)  # the first of the longest


def _repeated_blocks(container: torch.nn.Module) -> bool:
    children = list(container.children())
    return bool(children) and all(type(c) is type(children[0]) and any(True for _ in c.children()) for c in children)
