"""A tensor-parallel rank other than 0: its shard of the decoder and its own KV cache, running whatever step rank 0
sends. It schedules nothing and samples nothing: the engine (rank 0) owns the scheduler, the slot allocator, the
prefix cache and sampling, and every step's slots reach this rank in the step's message."""

from __future__ import annotations

import logging

import torch

from language.config import EngineConfig, resolve_device
from language.kernels.launch_utils import set_pdl
from language.model_builder import build_kv_cache, load_model, model_config
from language.model_runner import ModelRunner
from language.parallel import step_sync
from language.parallel.group import init_tp
from language.parallel.step_sync import StepChannel

logger = logging.getLogger(__name__)


class TPWorker:
    def __init__(self, cfg: EngineConfig, rank: int):
        if not 0 < rank < cfg.tp:
            raise ValueError(f"worker rank {rank} outside 1..{cfg.tp - 1}")
        self.rank = rank
        self.device = resolve_device(cfg.device, rank % cfg.ranks_per_node)
        set_pdl(cfg.pdl)
        torch.manual_seed(cfg.seed)
        model_config(cfg)  # a tp that cannot split the model: the message before waiting for the other ranks
        self.tp = init_tp(rank, cfg.tp, cfg.dist_init_method, self.device)
        model, lm = load_model(cfg, self.device, self.tp)
        kv = build_kv_cache(cfg, model, lm, self.device, self.tp)
        self.channel = StepChannel(self.tp)
        self.runner = ModelRunner(
            model, kv, self.device, cfg.cuda_graph, cfg.graph_max_batch_size, self.channel,
            piecewise_cuda_graph_max_tokens=cfg.piecewise_cuda_graph_max_tokens,
        )  # fmt: skip
        logger.info("tensor parallel rank %d ready on %s: %d KV slots", rank, self.device, kv.num_slots)

    def serve(self) -> None:
        """Run rank 0's steps until it says stop."""
        while True:
            msg = self.channel.recv()
            if msg.kind == step_sync.STOP:
                logger.info("tensor parallel rank %d: rank 0 stopped", self.rank)
                return
            self.runner.follow(msg)
