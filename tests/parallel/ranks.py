"""Running a function on 2 tensor-parallel ranks (gloo, CPU) in spawned processes, and collecting rank 0's result."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable

from mmserve.testing.server_proc import free_port

WORLD = 2


def _entry(fn: Callable, rank: int, init_method: str, args: tuple, results) -> None:
    import torch

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    try:
        results.put((rank, "ok", fn(rank, init_method, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, *args, timeout_s: float = 120.0) -> object:
    """fn(rank, init_method, *args) on each rank; returns rank 0's value, raising any rank's error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, init_method, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    try:
        while len(out) < WORLD:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks did not finish in {timeout_s:.0f}s (done: {sorted(out)})") from None
            out[rank] = (status, value)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return out[0][1]
