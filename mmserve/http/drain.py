"""Graceful stop. On SIGTERM (or Ctrl-C) the server drains: new requests get 503 with `Retry-After` (and /health
answers 503 "draining", so a load balancer takes the server out), while the requests in flight may finish for up
to `--graceful_timeout` seconds; those still running then are ended with a 503 / an error event. Then uvicorn
stops, and the caller stops the children and removes what the server made. A second signal stops at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import uvicorn
from starlette.responses import JSONResponse

from mmserve.launch.processes import hurry_stop

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a refused client is told to wait (another replica, or this server restarted, takes over)
# Still answered while draining: the stop is worth watching, and the process is alive (a liveness probe that failed
# now would have the server killed before its requests finish).
_NOT_GATED = ("/metrics", "/liveness")
_STOPPING = "the server is shutting down"
# The refusal of the probes, in each one's own shape (LightLLM's for /healthz and /readiness).
_PROBE_REFUSALS = {
    "/health": {"status": "draining", "error": _STOPPING, "message": "Error"},
    "/healthz": {"message": "Error", "error": _STOPPING},
    "/readiness": {"status": "not ready", "error": _STOPPING},
}


class DrainGate:
    """ASGI wrapper: counts the HTTP requests in flight, and refuses new ones once `draining` is set."""

    def __init__(self, app):
        self.app = app
        self.draining = False
        self.active = 0  # HTTP requests let in and not yet answered in full (a stream counts until its end)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] not in _NOT_GATED:
            await self._refuse(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1

    @staticmethod
    async def _refuse(scope, receive, send) -> None:
        body = _PROBE_REFUSALS.get(scope["path"], {"error": f"{_STOPPING}: retry on another server or later"})
        headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
        await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT starts a drain instead of stopping at once, and whose second one
    stops at once: the requests still running are ended (an error event, a 503), and the children are given a short
    grace. `end_requests(reason)` ends the requests still running (the drain ran out of time, or a second signal
    came)."""

    _HURRIED_GRACE_S = 0.5  # after a second signal: how long the ended requests get to write their last bytes

    def __init__(
        self, config: uvicorn.Config, gate: DrainGate, graceful_timeout_s: float, end_requests: Callable[[str], None]
    ):
        super().__init__(config)
        self.gate = gate
        self.graceful_timeout_s = graceful_timeout_s
        self.end_requests = end_requests
        self._deadline: float | None = None
        self._hurried = False  # a second signal came: on_tick ends what runs and stops

    @property
    def stopping(self) -> bool:
        """A stop is under way (a drain, or after it): a child that exits now is not one to replace."""
        return self.gate.draining or self.should_exit

    def handle_exit(self, sig, frame) -> None:
        if self.started and not self.should_exit and not self.gate.draining:
            self._captured_signals.append(sig)  # re-raised once the server has stopped, as uvicorn does
            self.gate.draining = True  # only a flag here (a signal handler): on_tick does the rest
            return
        if self.started and not self._hurried:
            hurry_stop()  # the children's stop, after uvicorn's, waits only briefly too
            self._hurried = True  # flags again: on_tick ends the requests on the event loop
            return
        super().handle_exit(sig, frame)  # before the start: stop now
        if self._hurried:
            self.force_exit = True  # a third signal: not even the ended requests' last bytes

    async def on_tick(self, counter: int) -> bool:
        if self._hurried and not self.should_exit:
            return self._stop_now()
        if self.gate.draining and not self.should_exit:
            now = time.monotonic()
            if self._deadline is None:
                self._deadline = now + self.graceful_timeout_s
                logger.warning("stopping: new requests get 503; %d in flight may finish within %.0f s "
                               "(--graceful_timeout)", self.gate.active, self.graceful_timeout_s)  # fmt: skip
            if self.gate.active == 0:
                logger.warning("stopping: every request has finished")
                self.should_exit = True
            elif now >= self._deadline:
                logger.warning("stopping: --graceful_timeout ran out; ending %d request(s)", self.gate.active)
                self.end_requests("the server is shutting down (--graceful_timeout ran out)")
                self.should_exit = True
        return await super().on_tick(counter)

    def _stop_now(self) -> bool:
        """A second signal: end every request still running (each gets its error event or 503), and give them
        only a moment to write it."""
        if self.gate.active:
            logger.warning("stopping at once (a second signal): ending %d request(s)", self.gate.active)
        self.gate.draining = True
        self.end_requests("the server is shutting down at once (a second signal)")
        self.config.timeout_graceful_shutdown = self._HURRIED_GRACE_S  # uvicorn's wait for them, next
        self.should_exit = True
        return True
