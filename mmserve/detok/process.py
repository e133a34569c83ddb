"""The detokenizer process: router batches in, text batches out to the HTTP server, stop-sequence aborts back to the
router."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import zmq

from mmserve.detok.detokenizer import Detokenizer
from mmserve.ipc.endpoints import Endpoints
from mmserve.ipc.messages import ReadyInfo, RouterBatch
from mmserve.ipc.zmq_queue import PullQueue, PushQueue
from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import parent_alive, run_child
from mmserve.prep.tokenization import load_tokenizer

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle detokenizer checks that its parent is still there


def serve_detokenizer(
    detok: Detokenizer, inbox: PullQueue, to_http: PushQueue, to_router: PushQueue, parent_pid: int
) -> None:
    while parent_alive(parent_pid):
        for batch in inbox.drain(_IDLE_POLL_MS):
            if not isinstance(batch, RouterBatch):
                raise TypeError(f"detokenizer got {type(batch).__name__}")
            text_batch, aborts = detok.handle(batch)
            for abort in aborts:
                to_router.send(abort)
            if text_batch.outputs or text_batch.stats is not None:
                to_http.send(text_batch)
    logger.info("parent process is gone; detokenizer exits")


def run_detokenizer_process(config: ServerConfig, endpoints: Endpoints, ready: Connection) -> None:
    def start():
        tokenizer = load_tokenizer(config)
        ctx = zmq.Context()
        inbox = PullQueue(ctx, endpoints.detokenizer)
        to_http = PushQueue(ctx, endpoints.http)
        to_router = PushQueue(ctx, endpoints.router)

        def serve(parent_pid: int) -> None:
            try:
                serve_detokenizer(Detokenizer(tokenizer), inbox, to_http, to_router, parent_pid)
            finally:
                for q in (inbox, to_http, to_router):
                    q.close()
                ctx.term()

        return ReadyInfo(process="detokenizer"), serve

    run_child("detokenizer", config.log_level, ready, start)
