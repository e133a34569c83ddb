"""CUDA MPS for the server's two GPU processes. Serving images, the vision tower (visual process) and the language
model (router process) share one GPU. Without MPS the driver time-slices their two contexts: no kernel of one runs
beside a kernel of the other, and the GPU switches between them. Under an MPS server both run as clients of one
context, and their kernels share the SMs. On an H100, 64 x 896 px images gave 5-9 % more requests/s and an earlier
TTFT p50 (docs/performance.md, "One GPU, two processes").

`--cuda_mps auto` starts an MPS control daemon of the server's own (`nvidia-cuda-mps-control -d`, its
pipe and log directories in /tmp/mmsv-mps-<pid>) before the children start, and stops it after them. It does so
only where MPS applies: a multimodal server on one GPU (`--tp 1`), on a host with the daemon's binary and an NVIDIA
GPU. Where CUDA_MPS_PIPE_DIRECTORY is set, the children are clients of the user's daemon there instead.
A client context is created first, in a short subprocess through the driver API. If it cannot connect, the daemon is
stopped and the server runs without MPS (`auto`) or does not start (`on`). A daemon left by a server that was
killed outright is stopped at the next start.

The trade: under MPS a fatal GPU fault in one client (an illegal address) reaches every client of the GPU's MPS
server, by NVIDIA's documentation, where two contexts would lose only the visual process (restarted alone).
`--cuda_mps off` keeps the two contexts apart."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from mmserve.launch.config import ServerConfig
from mmserve.launch.preflight import CannotStart
from mmserve.launch.processes import set_child_environment
from visual.pids import dead_owners_entries

logger = logging.getLogger("mmserve")

CONTROL = "nvidia-cuda-mps-control"
_PREFIX = "mmsv-mps-"
_OWNER = re.compile(rf"{_PREFIX}(\d+)$")
_TIMEOUT_S = 30.0  # for the daemon to start, or to answer
_QUIT_GRACE_S = 5  # for its clients to detach once told to quit
_GONE_S = 10.0  # for its processes to end after that
GPU_NODE = "/dev/nvidiactl"  # the NVIDIA driver's control device: there on a host with its GPUs
# A client of the daemon: the driver API's primary context on the first visible GPU; exits with the CUresult.
_CLIENT_CHECK = """import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
device, context = ctypes.c_int(), ctypes.c_void_p()
status = cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0)
status = status or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
sys.exit(min(status, 255))
"""


@dataclass(frozen=True)
class MpsDaemon:
    """A control daemon of this server's, in `root`: its clients are the processes started with `env`."""

    root: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.root, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.root, "log"),
        }

    def start(self) -> str | None:
        """Start the daemon and connect a client to it; None when both worked, else why not (the daemon stopped).
        The daemon runs in a session of its own, so a signal to the server's process group (systemd, `docker stop`,
        Ctrl-C) does not end it under the children while they drain: the server stops it after them."""
        try:
            for path in self.env.values():
                os.makedirs(path, exist_ok=True)
        except OSError as e:
            return f"cannot make its directories: {e}"
        error = _run([CONTROL, "-d"], self.env, f"{CONTROL} -d", new_session=True)
        if error is None:
            error = _run([sys.executable, "-c", _CLIENT_CHECK], self.env, "a CUDA context under it")
        if error is not None:
            self.stop()
        return error

    def stop(self) -> None:
        """Quit the daemon (it stops its server, whose clients have exited by now), wait until its processes are
        gone (killing what is left after _GONE_S) and remove its directories."""
        session = _session_of(_read_pid(self._daemon_pid_file))  # read while the daemon still runs
        if os.path.exists(os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")):
            # A client still attached (a process the server could not stop) would hold up a plain quit; after
            # _QUIT_GRACE_S the daemon shuts its server down regardless.
            _run([CONTROL], self.env, f"{CONTROL} quit", stdin=f"quit -t {_QUIT_GRACE_S}\n".encode())
        if session is not None:
            _end_session(session)
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def _daemon_pid_file(self) -> str:
        """The daemon's pid, which it writes."""
        return os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], f"{CONTROL}.pid")


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):  # never started, or not by us
        return None


def _run(
    argv: list[str], env: dict[str, str], what: str, stdin: bytes | None = None, new_session: bool = False
) -> str | None:
    """Run argv with env added (in a session of its own with `new_session`); None if it exited 0, else what failed,
    in one line."""
    try:
        done = subprocess.run(
            argv,
            input=stdin,
            env={**os.environ, **env},
            capture_output=True,
            timeout=_TIMEOUT_S,
            start_new_session=new_session,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{what} failed: {e}"
    if done.returncode != 0:
        last = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        return f"{what} failed with exit code {done.returncode}" + (f" ({last[-1]})" if last else "")
    return None


def _stat(pid: int | str) -> tuple[str, list[str]] | None:
    """A live process's command name and the /proc/<pid>/stat fields after it (state, ppid, pgrp, session, ...);
    None for a zombie or no process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            command, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
    except (OSError, ValueError, IndexError):
        return None
    fields = rest.split()
    return None if fields[0] == "Z" else (command, fields)


def _session_of(pid: int | None) -> int | None:
    """The session of the daemon `pid` (it makes one of its own; its MPS server joins it), or None."""
    stat = None if pid is None else _stat(pid)
    return int(stat[1][3]) if stat is not None else None


def _session_pids(session: int, command_prefix: str = "nvidia-cuda-mps") -> list[int]:
    """The MPS processes of a session (by their command's name, so that a pid reused since by another program's
    session is never taken for one), from /proc."""
    pids = []
    for name in os.listdir("/proc"):
        stat = _stat(name)
        if stat is not None and int(stat[1][3]) == session and stat[0].startswith(command_prefix):
            pids.append(int(name))
    return pids


def _end_session(session: int, command_prefix: str = "nvidia-cuda-mps") -> None:
    """Wait until the session's MPS processes are gone, then kill what is left after _GONE_S."""
    deadline = time.monotonic() + _GONE_S
    while (pids := _session_pids(session, command_prefix)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def why_not_mps(config: ServerConfig) -> str | None:
    """None where the server's GPU processes can run under an MPS daemon of its own, else why not."""
    if config.cuda_mps == "off":
        return "--cuda_mps off"
    if not config.enable_multimodal:
        return "one GPU process only (no --enable_multimodal)"
    if config.tp > 1:
        return "--tp above 1 (the ranks' NCCL traffic is not run under MPS here)"
    if config.device == "cpu":
        return "--device cpu"
    if shutil.which(CONTROL) is None:
        return f"no {CONTROL} on PATH"
    if not os.path.exists(GPU_NODE):
        return "no NVIDIA GPU on this host"
    return None


def start_mps(config: ServerConfig) -> MpsDaemon | None:
    """Before the children start: a daemon of this server's, its env set for every child spawned from now on (the
    visual process's restarts too), or None. Raises CannotStart where `--cuda_mps on` cannot be met."""
    if config.cuda_mps != "off" and os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        logger.info("CUDA MPS: the GPU processes are clients of the daemon in $CUDA_MPS_PIPE_DIRECTORY")
        return None
    reason = why_not_mps(config)
    if reason is None:
        daemon = MpsDaemon(os.path.join(tempfile.gettempdir(), f"{_PREFIX}{os.getpid()}"))
        reason = daemon.start()
        if reason is None:
            set_child_environment(daemon.env)  # not this process's: a client of the daemon would hold up its quit
            logger.info("CUDA MPS: the vision tower and the language model share the GPU (--cuda_mps off: apart)")
            return daemon
        if config.cuda_mps == "auto":
            logger.warning("running without CUDA MPS: %s", reason)
    if config.cuda_mps == "on":
        raise CannotStart(f"--cuda_mps on: {reason}")
    return None


def remove_dead_mps(directory: str | None = None) -> list[str]:
    """Stop the daemons of servers no longer running and remove their directories; returns their names."""
    directory = directory or tempfile.gettempdir()
    dead = dead_owners_entries(directory, _OWNER)
    for name in dead:
        MpsDaemon(os.path.join(directory, name)).stop()
    return dead
