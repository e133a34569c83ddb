"""Starting, watching and stopping the server's child processes (router, detokenizer, visual)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from mmserve.launch.semaphores import name_semaphores_after

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


class ChildStartError(RuntimeError):
    pass


_IMPORTED_AT = time.monotonic()  # fallback start time where /proc cannot tell when the process started


def seconds_since_process_start() -> float:
    """How long this process has run, by the kernel's clock, so that interpreter start-up and the imports (torch
    alone takes seconds) count in the start-up time we report, not only the part after main() begins."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, in clock ticks after boot); split after the command name, which may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


# --------------------------------------------------------------------------------------------- inside a child


# Libraries whose DEBUG lines would drown ours (PIL dumps every PNG chunk it reads): they stay at INFO when the
# server runs at --log_level debug.
_CHATTY_LOGGERS = ("PIL", "httpx", "httpcore", "asyncio", "urllib3", "filelock", "fsspec")


def configure_logging(log_level: str, name: str = "%(name)s") -> None:
    """The root logger at `log_level`, each line tagged with `name` (a child's process name, or the logger's)."""
    level = log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    if level == "DEBUG":
        for chatty in _CHATTY_LOGGERS:
            logging.getLogger(chatty).setLevel(logging.INFO)


# The server's children ignore the shutdown signals: systemd (KillMode=control-group) and a shell wrapper under
# `docker stop` send SIGTERM to the whole process group, and Ctrl-C sends SIGINT to it, but only the parent decides
# to stop: it drains, then stops each child with STOP_SIGNAL.
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A real-time signal, whose default action ends a process that installed no handler (a tensor-parallel rank). Not
# SIGUSR1: the LLVM inside Triton's compiler takes SIGUSR1 over in any process that compiles a kernel (its "info"
# signal) and swallows it, so a child that compiled one (a cold Triton cache, a new shape) ignored its stop and was
# killed after the grace. LLVM leaves real-time signals alone (tests/unit/mmserve/test_stop_signal.py).
STOP_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1


def ignore_shutdown_signals() -> None:
    """First thing in a child: SIGINT and SIGTERM ignored from now on, and let through again (spawn_child blocked
    them around the start, so that one sent meanwhile waited; it is dropped now)."""
    for sig in SHUTDOWN_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHUTDOWN_SIGNALS)


def setup_child(name: str, log_level: str) -> int:
    """Signal handling of a child: it ignores the shutdown signals and exits on STOP_SIGNAL, which the parent sends,
    and the kernel too if the parent dies, even outright. Returns the parent's pid."""
    ignore_shutdown_signals()
    parent_pid = os.getppid()
    name_semaphores_after(parent_pid)
    configure_logging(log_level, name)
    signal.signal(STOP_SIGNAL, _exit_on_stop)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, STOP_SIGNAL)
        libc.prctl(_PR_SET_NAME, f"mmserve-{name}"[:15].encode())  # what ps/top show (/proc/PID/comm)
    except OSError:  # not Linux/glibc: parent_alive() polling still catches a dead parent
        pass
    return parent_pid


def _exit_on_stop(signum, frame) -> None:
    raise SystemExit(0)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def run_child(name: str, log_level: str, ready: Connection, start: Callable[[], tuple[object, Callable]]) -> None:
    """Run a child's body: `start()` loads what it needs and returns (ready info, serve loop taking the parent pid).
    A start failure is reported over the pipe with its traceback, and only there: the parent says why in one line
    (with the traceback at --log_level debug), instead of every failing process printing its own."""
    parent_pid = setup_child(name, log_level)
    # Start-up, phase by phase (with the engine's and visual model's own lines): what the 30 s budget goes to.
    logger.info("%s process up after %.1f s (interpreter, imports)", name, seconds_since_process_start())
    try:
        info, serve = start()
    except SystemExit:  # STOP_SIGNAL while loading: the parent is stopping, nobody waits for an answer
        exit_now(0)
    except BaseException:
        _report_start_failure(ready, traceback.format_exc())
        exit_now(1)
    freeze_startup_objects()
    logger.info("%s process ready after %.1f s", name, seconds_since_process_start())
    ready.send(("ready", info))
    ready.close()
    try:
        serve(parent_pid)
    except SystemExit as e:  # STOP_SIGNAL: `serve` closed its sockets on the way out
        exit_now(e.code if isinstance(e.code, int) else 0)
    exit_now(0)


def _report_start_failure(ready: Connection, trace: str) -> None:
    try:
        ready.send(("error", trace))
    except OSError:  # the parent is gone or stopped listening: say it here, then
        sys.stderr.write(trace)


def start_failure_summary(trace: str) -> str:
    """The line of a child's start-failure traceback that says why: the exception and its message."""
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no reason given"


def freeze_startup_objects() -> None:
    """Once a process has started: put every object alive now (modules, the model's and tokenizer's Python
    objects: ~0.5M of them) out of the cyclic garbage collector's reach. A full collection would otherwise scan
    them all, a 0.1-0.7 s pause of the step loop or the event loop in the middle of a load (SGLang and vLLM do the
    same); objects made while serving are still collected."""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch and friends (seconds on a small machine): everything that
    needs closing was closed by the caller; only the log and std streams are flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------- in the parent


@dataclass
class ChildProcess:
    name: str
    process: mp.process.BaseProcess
    ready_conn: Connection
    info: object | None = None  # what the child sent when ready (ReadyInfo, or the visual process's VisualReady)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def alive(self) -> bool:
        return self.process.is_alive()


_child_environment: dict[str, str] = {}


def set_child_environment(env: dict[str, str]) -> None:
    """Variables every child spawned from now on sets first thing (the server's CUDA MPS daemon's directories: see
    mmserve/launch/mps.py), while this process's own environment stays as it is."""
    _child_environment.update(env)


def spawn_child(name: str, target: Callable | str, *args) -> ChildProcess:
    """Start `target(*args, ready_conn)` in a fresh interpreter (spawn: no forked CUDA or zmq state). `target` may
    be named "package.module:function", so that the parent need not import the child's module (and torch) first.
    The child starts with the shutdown signals blocked (a signal mask survives fork and exec), so that one sent to
    the process group while its interpreter starts waits until it ignores them (ignore_shutdown_signals)."""
    ctx = mp.get_context("spawn")
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    target, args = _run_child, (target, dict(_child_environment), *args)
    # Not daemonic: a child may need its own workers (the visual process's preprocessing pool). The parent stops
    # its children itself (stop_children), and a child whose parent vanished exits on its own (setup_child).
    proc = ctx.Process(target=target, args=(*args, send_conn), name=f"mmserve-{name}", daemon=False)
    # Blocked in this thread only (a signal then goes to another thread, or waits here): never lost for the parent.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    send_conn.close()
    return ChildProcess(name, proc, recv_conn)


def _run_child(target: Callable | str, environment: dict[str, str], *args) -> None:
    os.environ.update(environment)  # before anything reads it (CUDA reads the MPS variables when it starts)
    if not isinstance(target, str):
        target(*args)
        return
    ignore_shutdown_signals()  # before the imports: torch alone takes seconds
    from visual.hf_imports import skip_docstring_generation

    skip_docstring_generation()  # before the child imports any transformers config or model class
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def wait_ready(children: list[ChildProcess], timeout_s: float) -> None:
    """Block until every child reported ready; raise ChildStartError if one fails, dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    # Every child is watched at once, not only the next one awaited: the router waits for the tensor-parallel
    # ranks while it loads, so a rank that dies must be noticed while the router is still loading.
    pending = [c for c in children if c.info is None]
    while pending:
        for child in list(pending):
            if child.ready_conn.poll(0.1 if child is pending[0] else 0):
                try:
                    status, payload = child.ready_conn.recv()
                except EOFError:
                    raise ChildStartError(f"{child.name} process exited during start (code {child.exitcode})") from None
                if status != "ready":
                    logger.debug("%s process start failure:\n%s", child.name, payload)
                    reason = start_failure_summary(payload)
                    raise ChildStartError(f"{child.name} process failed to start: {reason}")
                child.info = payload
                pending.remove(child)
            elif not child.alive():
                raise ChildStartError(f"{child.name} process exited during start (code {child.exitcode})")
        if pending and time.monotonic() > deadline:
            raise ChildStartError(f"{pending[0].name} process not ready after {timeout_s:.0f}s")


_hurry = threading.Event()  # a second shutdown signal came: stop the children now


def hurry_stop() -> None:
    """Shorten stop_children's wait (safe in a signal handler: only sets a flag)."""
    _hurry.set()


def stop_children(children: list[ChildProcess], grace_s: float = 5.0, hurried_grace_s: float = 1.0) -> None:
    """Send every child STOP_SIGNAL, wait (`hurried_grace_s` at most once hurry_stop() was called), then SIGKILL
    the ones still there; reap all of them."""
    for child in children:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(child.pid, STOP_SIGNAL)
    start = time.monotonic()
    for child in children:
        while child.alive():
            waited = time.monotonic() - start
            if waited >= (hurried_grace_s if _hurry.is_set() else grace_s):
                break
            child.process.join(0.05)
        if child.alive():
            logger.warning("%s process did not stop in time; killing it", child.name)
            child.process.kill()
            child.process.join()
        child.ready_conn.close()
