"""`python -m mmserve.api_server` / `mmserve`: start the router and detokenizer processes, wait until the model is
loaded, then serve HTTP until SIGINT/SIGTERM (a drain: see mmserve.http.drain; or a child dies, then exit non-zero).
Every child is stopped on the way out, and the server's sockets and shared memory are removed."""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

from cache.shm_store import new_prefix, remove_dead_segments, unlink_all
from mmserve.ipc.endpoints import Endpoints, remove_dead_ipc_dirs
from mmserve.launch.children import spawn_detokenizer, spawn_router, spawn_visual
from mmserve.launch.cli import parse_config
from mmserve.launch.config import ServerConfig
from mmserve.launch.demo import demo_for, ensure_demo_checkpoint
from mmserve.launch.mps import remove_dead_mps, start_mps
from mmserve.launch.preflight import CannotStart, bind_http_sockets, check_model_dir
from mmserve.launch.processes import (
    SHUTDOWN_SIGNALS,
    ChildProcess,
    ChildStartError,
    configure_logging,
    exit_now,
    hurry_stop,
    stop_children,
)
from mmserve.launch.semaphores import name_semaphores_after, remove_dead_semaphores
from mmserve.launch.tp_workers import check_tp_split, serve_worker_node, spawn_tp_workers

# Light imports only (the spawned children import this module again): the HTTP side's heavy ones (FastAPI,
# transformers, torch) wait in mmserve.launch.frontend until the children are on their way.
logger = logging.getLogger("mmserve")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until it stops, then exit the process with its status (0: stopped by a signal; 1: failed)."""
    config = parse_config(argv)
    configure_logging(config.log_level)
    name_semaphores_after(os.getpid())  # and every child names its own after this process (setup_child)
    raise_fd_limit()
    # SIGTERM unwinds like Ctrl-C, so the `finally` in serve() stops the children even while they are still loading;
    # a second signal only hurries that stop along.
    for sig in SHUTDOWN_SIGNALS:
        signal.signal(sig, _on_shutdown_signal)
    try:
        if config.node_rank > 0:  # another host's share of the tensor-parallel ranks: no HTTP, no engine
            code = serve_worker_node(config)
        else:
            code = serve(resolve_model(config))
    except KeyboardInterrupt:
        logger.info("stopped")
        code = 0
    except CannotStart as e:
        logger.error("cannot start: %s", e)
        code = 1
    exit_now(code)  # children, sockets and temp files are cleaned up by now
    return code


def raise_fd_limit() -> None:
    """Every client connection is a file descriptor: lift the soft limit (often 1024) to the hard one, so that
    thousands of concurrent streams are admitted (and wait in the queue) instead of failing in accept()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            logger.warning("could not raise the open-file limit from %d: at most that many connections", soft)


_stopping = False


def _on_shutdown_signal(signum, frame) -> None:
    """Outside uvicorn's run (while the children load, and while they are stopped): the first signal unwinds,
    the next ones make the stop kill what is slow to go."""
    global _stopping
    if _stopping:
        hurry_stop()
        return
    _stopping = True
    raise KeyboardInterrupt


def resolve_model(config: ServerConfig) -> ServerConfig:
    if config.model_dir is not None:
        return config
    # --enable_multimodal picks the Qwen2-VL demo, since a Llama has no vision tower to serve images with.
    path = ensure_demo_checkpoint(multimodal=config.enable_multimodal)
    logger.warning(
        "no --model_dir given: serving the DEMO checkpoint in %s, %s with RANDOM weights (its text is "
        "gibberish). Pass --model_dir /path/to/hf/checkpoint to serve a real model.",
        path,
        demo_for(config.enable_multimodal).description,
    )
    return replace(config, model_dir=path)


def serve(config: ServerConfig) -> int:
    """Serve until stopped; returns the exit status. Raises CannotStart before any child starts."""
    check_model_dir(config)
    if (error := check_tp_split(config)) is not None:  # before any child starts
        raise CannotStart(error)
    listeners = bind_http_sockets(config.host, config.port)
    remove_leftovers()
    endpoints = Endpoints.create()
    shm_prefix = new_prefix() if config.enable_multimodal else None
    children: list[ChildProcess] = []
    mps = None
    try:
        mps = start_mps(config)  # before the children: they inherit its environment
        children.append(spawn_router(config, endpoints, shm_prefix))
        children.append(spawn_detokenizer(config, endpoints))
        if shm_prefix:
            children.append(spawn_visual(config, endpoints, shm_prefix))
        children += spawn_tp_workers(config)  # this host's ranks other than 0 (rank 0 is the router)
        from mmserve.launch.frontend import run_frontend  # FastAPI, transformers, torch: while the children load

        return run_frontend(config, endpoints, shm_prefix, children, listeners)
    except ChildStartError as e:
        logger.error("cannot start: %s", e)
        return 1
    finally:
        for sock in listeners:
            sock.close()
        stop_children(children)
        if mps is not None:
            mps.stop()
        endpoints.remove()
        if shm_prefix:
            unlink_all(shm_prefix)  # every embedding segment, also after a child crashed


def remove_leftovers() -> None:
    """What servers killed outright (SIGKILL, OOM) left: /dev/shm segments, zmq ipc socket dirs, semaphores, MPS
    daemons."""
    for what, removed in (
        ("shared-memory segment", remove_dead_segments()),
        ("ipc socket dir", remove_dead_ipc_dirs()),
        ("semaphore", remove_dead_semaphores()),
        ("CUDA MPS daemon", remove_dead_mps()),
    ):
        if removed:
            logger.info("removed %d %s(s) left by servers no longer running", len(removed), what)


if __name__ == "__main__":
    sys.exit(main())
