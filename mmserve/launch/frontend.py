"""The server's HTTP side, assembled once the children are on their way: tokenizer and image processor (loaded
while the children load), the link to the visual process and its supervisor, the engine client, the FastAPI app
and uvicorn. `mmserve.api_server` starts the children first and calls `run_frontend`; it cleans up after it."""

from __future__ import annotations

import logging
import socket

import uvicorn

from language.engine_stats import EngineStats
from mmserve.http.drain import DrainGate, DrainingServer
from mmserve.http.engine_client import EngineClient
from mmserve.http.first_use import warm_first_use
from mmserve.http.generation_defaults import sampling_defaults
from mmserve.http.metrics import ServerMetrics
from mmserve.http.openai_protocol import OpenAIOptions
from mmserve.http.server import build_app
from mmserve.http.slow_clients import ClientTimeouts, WriteTimeout
from mmserve.ipc.endpoints import Endpoints
from mmserve.ipc.messages import RouterStats
from mmserve.launch.children import spawn_visual
from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import ChildProcess, freeze_startup_objects, seconds_since_process_start, wait_ready
from mmserve.launch.visual_supervisor import VisualSupervisor
from mmserve.prep.tokenization import Limits, RequestPreparer, load_tokenizer
from mmserve.prep.visual_link import VisualLink, load_prompt_processor

logger = logging.getLogger("mmserve")


def run_frontend(
    config: ServerConfig,
    endpoints: Endpoints,
    shm_prefix: str | None,
    children: list[ChildProcess],
    listeners: list[socket.socket],
) -> int:
    """Serve HTTP on `listeners` (bound, not yet listening) until the server stops; returns the exit status.
    `children`: router, detokenizer, then the visual process (with `shm_prefix`) and this host's other
    tensor-parallel ranks, all spawned and still loading. Raises ChildStartError when one fails to start."""
    tokenizer = load_tokenizer(config)  # while the children load
    try:
        processor = load_prompt_processor(config, tokenizer) if shm_prefix else None
    except ValueError as e:  # an architecture with no image support
        logger.error("cannot start with --enable_multimodal: %s", e)
        return 1
    wait_ready(children, config.startup_timeout_s)
    info = children[0].info
    metrics = ServerMetrics()
    metrics.on_stats(RouterStats(EngineStats(0, 0, 0, info.max_total_token_num)))  # before the router's first stats
    visual_child = children[2] if shm_prefix else None
    visual = VisualLink(config, endpoints, shm_prefix, visual_child.info, processor) if visual_child else None
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
            stopping=lambda: server.stopping,
        )
        services = [visual, supervisor]
        metrics.registry.register(visual)
        metrics.registry.register(supervisor)
    limits = Limits(info.request_limit)
    preparer = RequestPreparer(tokenizer, limits, images=visual)
    # Every child is vital but the visual process, which is supervised (restarted) instead.
    vital = [c for c in children if c is not visual_child]
    client = EngineClient(preparer, vital, endpoints, metrics, config.tokenizer_workers, services=services)
    timeouts = ClientTimeouts(config.request_read_timeout, config.stream_write_timeout)
    openai = OpenAIOptions(
        config.image_dir,
        config.served_model_name,
        config.chat_template,
        config.model_dir,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        sampling_defaults=sampling_defaults(config.generation_config, config.model_dir, config.generation_overrides()),
    )
    app = build_app(client, openai, timeouts)
    warm_first_use(app)
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
        end_requests=client.fail_in_flight,
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
        server.run(sockets=listeners)
    except KeyboardInterrupt:  # the stopping signal, re-raised by uvicorn once it has stopped
        pass
    if client.failure is not None:
        logger.error("exiting after a failure: %s", client.failure)
        return 1
    return 0 if server.started else 1
