"""`python -m mmserve.api_server` / `mmserve`: start the router and detokenizer processes, wait until the model is
loaded, then serve HTTP until SIGINT/SIGTERM (a drain: see mmserve.drain; or a child dies, then exit non-zero).
Every child is stopped on the way out, and the server's sockets and shared memory are removed."""

from __future__ import annotations

import logging
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

import uvicorn

from cache.shm_store import new_prefix, remove_dead_segments, unlink_all
from mmserve.cli import parse_config
from mmserve.config import ServerConfig
from mmserve.demo import demo_for, ensure_demo_checkpoint
from mmserve.detokenizer_process import run_detokenizer_process
from mmserve.drain import DrainGate, DrainingServer
from mmserve.engine_client import EngineClient
from mmserve.http_server import build_app
from mmserve.messages import RouterStats
from mmserve.metrics import ServerMetrics
from mmserve.openai_protocol import OpenAIOptions
from mmserve.processes import (
    ChildProcess,
    ChildStartError,
    exit_now,
    freeze_startup_objects,
    seconds_since_process_start,
    spawn_child,
    stop_children,
    wait_ready,
)
from mmserve.router import run_router_process
from mmserve.slow_clients import ClientTimeouts, WriteTimeout
from mmserve.tokenization import Limits, RequestPreparer, load_tokenizer
from mmserve.tp_workers import check_tp_split, serve_worker_node, spawn_tp_workers
from mmserve.visual_link import ShmEmbedReader, VisualLink, spawn_visual
from mmserve.visual_supervisor import VisualSupervisor
from mmserve.zmq_queue import Endpoints, remove_dead_ipc_dirs

logger = logging.getLogger("mmserve")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until it stops, then exit the process with its status (0: stopped by a signal; 1: failed)."""
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise_fd_limit()
    # SIGTERM unwinds like Ctrl-C, so the `finally` in serve() stops the children even while they are still loading.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if config.node_rank > 0:  # another host's share of the tensor-parallel ranks: no HTTP, no engine
            code = serve_worker_node(config)
        else:
            code = serve(resolve_model(config))
    except KeyboardInterrupt:
        logger.info("stopped")
        code = 0
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


def _raise_keyboard_interrupt(signum, frame) -> None:
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
    if (error := check_tp_split(config)) is not None:  # before any child starts
        logger.error("cannot start: %s", error)
        return 1
    removed = remove_dead_segments()  # what servers killed outright (SIGKILL, OOM) left in /dev/shm
    if removed:
        logger.info("removed %d shared-memory segment(s) left by servers no longer running", len(removed))
    removed = remove_dead_ipc_dirs()  # and their zmq ipc socket directories
    if removed:
        logger.info("removed %d ipc socket dir(s) left by servers no longer running", len(removed))
    endpoints = Endpoints.create()
    shm_prefix = new_prefix() if config.enable_multimodal else None
    children: list[ChildProcess] = []
    try:
        embed_reader = ShmEmbedReader(shm_prefix) if shm_prefix else None
        children.append(spawn_child("router", run_router_process, config, endpoints, embed_reader))
        children.append(spawn_child("detokenizer", run_detokenizer_process, config, endpoints))
        if shm_prefix:
            children.append(spawn_visual(config, endpoints, shm_prefix))
        children += spawn_tp_workers(config)  # this host's ranks other than 0 (rank 0 is the router)
        tokenizer = load_tokenizer(config)  # while the children load
        wait_ready(children, config.startup_timeout_s)
        info = children[0].info
        metrics = ServerMetrics()
        metrics.on_stats(RouterStats(kv_total=info.max_total_token_num))  # before the router's first stats arrive
        visual_child = children[2] if shm_prefix else None
        visual = VisualLink(config, endpoints, shm_prefix, visual_child.info, tokenizer) if visual_child else None
        services: list = []
        if visual is not None:
            supervisor = VisualSupervisor(
                children,
                visual_child,
                spawn=lambda: spawn_visual(config, endpoints, shm_prefix),
                max_restarts=config.visual_max_restarts,
                startup_timeout_s=config.startup_timeout_s,
                on_down=visual.on_visual_down,
                on_up=visual.on_visual_up,
                on_give_up=lambda reason: client.fatal(reason),
            )
            services = [visual, supervisor]
            metrics.registry.register(visual)
            metrics.registry.register(supervisor)
        # A request must fit both the model's context and the whole KV cache.
        limits = Limits(min(info.max_req_total_len, info.max_total_token_num))
        preparer = RequestPreparer(tokenizer, limits, images=visual)
        # Every child is vital but the visual process, which is supervised (restarted) instead.
        vital = [c for c in children if c is not visual_child]
        client = EngineClient(preparer, vital, endpoints, metrics, config.tokenizer_workers, services=services)
        timeouts = ClientTimeouts(config.request_read_timeout, config.stream_write_timeout)
        openai = OpenAIOptions(config.image_dir, config.served_model_name, config.chat_template)
        app = build_app(client, openai, timeouts)
        gate = DrainGate(WriteTimeout(app, timeouts.write_s))
        server = DrainingServer(
            uvicorn.Config(
                gate,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                access_log=config.log_level == "debug",
                timeout_graceful_shutdown=3,  # after the drain: for the last bytes of the answers
            ),
            gate,
            config.graceful_timeout,
            on_timeout=lambda: client.fail_in_flight("the server is shutting down (--graceful_timeout ran out)"),
        )
        client.on_fatal = lambda: setattr(server, "should_exit", True)
        freeze_startup_objects()
        logger.info(
            "serving %s on http://%s:%d (started in %.1f s)",
            config.model_dir,
            config.host,
            config.port,
            seconds_since_process_start(),
        )
        try:
            server.run()
        except KeyboardInterrupt:  # the stopping signal, re-raised by uvicorn once it has stopped
            pass
        if client.failure is not None:
            logger.error("exiting after a failure: %s", client.failure)
            return 1
        return 0 if server.started else 1
    except ChildStartError as e:
        logger.error("%s", e)
        return 1
    finally:
        stop_children(children)
        endpoints.remove()
        if shm_prefix:
            unlink_all(shm_prefix)  # every embedding segment, also after a child crashed


if __name__ == "__main__":
    sys.exit(main())
