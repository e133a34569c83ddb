"""Supervision of the visual process. Text does not need it, so its death is not fatal: requests waiting on an
encoding fail at once (503), new images are refused (503) while cached ones are still served, `/health` says
"degraded", and the process is restarted with backoff (0.5 s, 1 s, 2 s, ... at most 10 s). After more than
`max_restarts` deaths or failed starts in a row (a process that stays up for `_STABLE_S` clears the count), the
server gives up: it fails fast (exits non-zero) so that systemd or Kubernetes restarts all of it.

Metrics: `mmserve_visual_up` (1 while it serves) and `mmserve_visual_restarts_total` (successful restarts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mmserve.launch.processes import ChildProcess, stop_children

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.1
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 10.0
_STABLE_S = 60.0  # up this long: earlier deaths no longer count towards giving up


class VisualSupervisor:
    """Watches the visual process on the HTTP event loop (a Service of the EngineClient) and restarts it.

    `children` is the server's list of every child to stop at exit: a restarted process takes the dead one's place
    in it. `on_down(reason)` / `on_up(ready_info)` tell the visual link; `on_give_up(reason)` stops the server.
    `stopping()` is true once the server stops: a process that exits then is not restarted."""

    def __init__(
        self,
        children: list[ChildProcess],
        child: ChildProcess,
        spawn: Callable[[], ChildProcess],
        max_restarts: int,
        startup_timeout_s: float,
        on_down: Callable[[str], None],
        on_up: Callable[[object], None],
        on_give_up: Callable[[str], None],
        stopping: Callable[[], bool] = lambda: False,
    ):
        self.children = children
        self.child = child
        self._spawn = spawn
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self._on_down, self._on_up, self._on_give_up = on_down, on_up, on_give_up
        self._stopping = stopping
        self.up = True
        self.down_reason: str | None = None
        self.restarts = 0
        self._strikes = 0  # deaths and failed starts since the process last stayed up for _STABLE_S
        self._up_since = time.monotonic()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def degraded(self) -> str | None:
        """Why the server is degraded (None while the visual process serves)."""
        return None if self.up else f"image requests are refused: {self.down_reason}"

    # ------------------------------------------------------------------------------------------- the loop

    async def _supervise(self) -> None:
        try:
            await self._watch_and_restart()
        except Exception as e:  # a broken supervisor must not leave image requests refused forever
            logger.exception("visual process supervision failed")
            self._on_give_up(f"visual process supervision failed: {e!r}")

    async def _watch_and_restart(self) -> None:
        while True:
            while self.child.alive():
                await asyncio.sleep(_WATCH_INTERVAL_S)
            reason = f"the visual process exited (code {self.child.exitcode})"
            if self._stopping():  # the server stops it, or it died meanwhile: either way nothing to replace
                logger.info("%s while the server stops; not restarted", reason)
                self.up, self.down_reason = False, reason
                self._on_down(reason)
                return
            if time.monotonic() - self._up_since >= _STABLE_S:
                self._strikes = 0
            self._mark_down(reason)
            while not await self._restart():
                pass
            if self._strikes > self.max_restarts:
                return

    async def _restart(self) -> bool:
        """One attempt, after its backoff; True when the process is back or the server gave up."""
        self._strikes += 1
        if self._strikes > self.max_restarts:
            self._give_up()
            return True
        delay = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (self._strikes - 1))
        logger.warning("restarting the visual process in %.1f s (attempt %d of %d)", delay, self._strikes,
                       self.max_restarts)  # fmt: skip
        await asyncio.sleep(delay)
        if self._stopping():
            logger.info("the server stops: the visual process is not restarted")
            return True
        self._replace(await asyncio.to_thread(self._spawn))  # off the loop: starting an interpreter takes a while
        error = await self._wait_ready(self.child)
        if error is not None:
            logger.error("the visual process failed to restart: %s", error)
            await asyncio.to_thread(self.child.process.join, 10)  # it reported its failure and is exiting
            await asyncio.to_thread(stop_children, [self.child])
            self.down_reason = f"the visual process failed to restart: {error.splitlines()[-1]}"
            return False
        self.restarts += 1
        self._up_since = time.monotonic()
        self.up, self.down_reason = True, None
        self._on_up(self.child.info)
        logger.warning("the visual process is back (restart %d); image requests are served again", self.restarts)
        return True

    def _mark_down(self, reason: str) -> None:
        logger.error("%s; image requests are refused until it is restarted", reason)
        self.up, self.down_reason = False, reason
        self.child.process.join(0)  # reap it
        self._on_down(reason)

    def _give_up(self) -> None:
        reason = f"the visual process died or failed to start {self._strikes} times in a row " \
                 f"(--visual_max_restarts {self.max_restarts}): giving up"  # fmt: skip
        logger.error("%s", reason)
        self._on_give_up(reason)

    def _replace(self, new: ChildProcess) -> None:
        old, self.child = self.child, new
        old.ready_conn.close()
        self.children[self.children.index(old)] = new

    async def _wait_ready(self, child: ChildProcess) -> str | None:
        """None once the child reported ready (its info set), else why it did not."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not child.ready_conn.poll():
            if not child.alive():
                return f"it exited during start (code {child.exitcode})"
            if time.monotonic() > deadline:
                return f"not ready after {self.startup_timeout_s:.0f} s"
            await asyncio.sleep(_WATCH_INTERVAL_S)
        try:
            status, payload = child.ready_conn.recv()
        except EOFError:
            return f"it exited during start (code {child.exitcode})"
        if status != "ready":
            return str(payload).rstrip()
        child.info = payload
        return None

    # prometheus_client custom collector
    def collect(self):
        yield GaugeMetricFamily("mmserve_visual_up", "1 while the visual process serves, 0 while it is down",
                                value=int(self.up))  # fmt: skip
        yield CounterMetricFamily("mmserve_visual_restarts", "Restarts of the visual process after it died",
                                  value=self.restarts)  # fmt: skip
