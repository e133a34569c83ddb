"""The tensor-parallel worker processes: one per rank other than 0 on this host (rank 0 is the router process,
which owns the engine). Each loads its shard of the decoder and runs the steps the engine broadcasts; the parent
watches them like any child, so a rank that dies fails the server at once (503s, /health down, exit non-zero)."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import STOP_SIGNAL, ChildProcess, run_child, spawn_child, stop_children, wait_ready

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerReady:
    process: str
    rank: int
    device: str
    kv_slots: int


def worker_name(rank: int) -> str:
    return f"tp{rank}"  # the process is mmserve-tp<rank> in ps/top


def run_tp_worker_process(config: ServerConfig, rank: int, ready: Connection) -> None:
    def start():
        # Waiting for rank 0's next step is a call into gloo that Python signal handlers cannot interrupt: the
        # parent's stop ends the process at once (it holds no shared memory or sockets of its own).
        signal.signal(STOP_SIGNAL, signal.SIG_DFL)
        import torch

        from language.parallel.worker import TPWorker

        cfg = config.engine_config()
        if cfg.tp > 1 and torch.device(cfg.device if cfg.device != "auto" else "cpu").type == "cpu":
            torch.set_num_threads(1)
        worker = TPWorker(cfg, rank)
        if worker.device.type == "cuda":
            torch.set_num_threads(1)  # as the router: a host thread pool only adds latency to launching kernels
        info = WorkerReady(worker_name(rank), rank, str(worker.device), worker.runner.kv.num_slots)
        return info, lambda parent_pid: worker.serve()

    run_child(worker_name(rank), config.log_level, ready, start)


def check_tp_split(config: ServerConfig) -> str | None:
    """Why --tp cannot split the model (its attention heads, KV heads or MLP width), or None when it can. Asked in
    the parent before any child starts: each rank finds it too, but only after seconds of imports, and by then the
    router and the visual process are loading as well."""
    if config.tp == 1 or config.model_dir is None:
        return None
    from language.model_builder import model_config  # only for tp > 1: the decoders import the kernels

    try:
        model_config(config.engine_config())
    except (ValueError, OSError) as e:  # OSError: no config.json, which the ranks would report the same way
        return str(e)
    return None


def spawn_tp_workers(config: ServerConfig) -> list[ChildProcess]:
    """This host's worker processes (every local rank but 0)."""
    return [spawn_child(worker_name(r), run_tp_worker_process, config, r) for r in config.local_ranks if r != 0]


def serve_worker_node(config: ServerConfig) -> int:
    """A host other than node 0 (--node_rank > 0): only its ranks, until one of them exits (rank 0 stopping ends
    them all) or this process is stopped. Returns the exit status: 0 when every rank stopped cleanly."""
    if (error := check_tp_split(config)) is not None:
        logger.error("cannot start: %s", error)
        return 1
    children = spawn_tp_workers(config)
    try:
        wait_ready(children, config.startup_timeout_s)
        logger.info("node %d: ranks %s ready", config.node_rank, list(config.local_ranks))
        while all(c.alive() for c in children):
            time.sleep(0.5)
        failed = [c for c in children if c.exitcode != 0]
        for c in failed:
            logger.error("rank process %s exited with code %s", c.name, c.exitcode)
        return 1 if failed else 0
    finally:
        stop_children(children)
