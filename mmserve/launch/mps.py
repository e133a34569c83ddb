"""CUDA MPS for the server's two GPU processes. Serving images, the vision tower (visual process) and the language
model (router process) share one GPU. Without MPS the driver time-slices their two contexts: no kernel of one runs
beside a kernel of the other, and the GPU switches between them. Under an MPS server both run as clients of one
context, and their kernels share the SMs. On an H100, 64 x 896 px images gave 5-9 % more requests/s and an earlier
TTFT p50 (docs/performance.md, "One GPU, two processes").

`--cuda_mps auto` (the default) starts an MPS control daemon of the server's own (`nvidia-cuda-mps-control -d`, its
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
# A client's exit waits for the MPS server to release its memory: with tens of GB of KV cache, about 5 s on an H100
# (past the children's usual grace, so they were killed).
MPS_STOP_GRACE_S = 20.0
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
        error = _run([CONTROL, "-d"], self.env, f"{CONTROL} -d", session_file=self._session_file)
        if error is None:
            error = _run([sys.executable, "-c", _CLIENT_CHECK], self.env, "a CUDA context under it")
        if error is not None:
            self.stop()
        return error

    def stop(self) -> None:
        """Quit the daemon (it stops its server, whose clients have exited by now), wait until its processes are
        gone (killing what is left after _GONE_S) and remove its directories."""
        sessions = {_read_pid(self._session_file), _read_pid(self._daemon_pid_file)} - {None}
        if os.path.exists(os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")):
            # A client still attached (a process the server could not stop) would hold up a plain quit; after
            # _QUIT_GRACE_S the daemon shuts its server down regardless.
            _run([CONTROL], self.env, f"{CONTROL} quit", stdin=f"quit -t {_QUIT_GRACE_S}\n".encode())
        _end_sessions(sessions)
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def _session_file(self) -> str:
        """The session the daemon was started in (by _run)."""
        return os.path.join(self.root, "session")

    @property
    def _daemon_pid_file(self) -> str:
        """The daemon's pid, which it writes; it may have made a session of its own."""
        return os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], f"{CONTROL}.pid")


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):  # never started, or not by us
        return None


def _run(
    argv: list[str], env: dict[str, str], what: str, stdin: bytes | None = None, session_file: str | None = None
) -> str | None:
    """Run argv with env added; None if it exited 0, else what failed, in one line. With `session_file`, argv runs
    in a new session whose id (its pid) is written there."""
    try:
        with subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            start_new_session=session_file is not None,
        ) as proc:
            if session_file is not None:
                with open(session_file, "w") as f:
                    f.write(str(proc.pid))
            try:
                stdout, stderr = proc.communicate(stdin, timeout=_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{what} failed: {e}"
    if done.returncode != 0:
        last = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        return f"{what} failed with exit code {done.returncode}" + (f" ({last[-1]})" if last else "")
    return None


def _session_pids(sessions: set[int], command_prefix: str = "nvidia-cuda-mps") -> list[int]:
    """The MPS processes (the daemon and the server it started; by their command's name, so that a pid reused
    since by another session leader is never taken for one) of these sessions, from /proc."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                command, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone
        fields = rest.split()  # state, ppid, pgrp, session, ...
        if fields[0] != "Z" and int(fields[3]) in sessions and command.startswith(command_prefix):
            pids.append(int(name))
    return pids


def _end_sessions(sessions: set[int], command_prefix: str = "nvidia-cuda-mps") -> None:
    """Wait until these sessions' MPS processes are gone, then kill what is left after _GONE_S."""
    deadline = time.monotonic() + _GONE_S
    while (pids := _session_pids(sessions, command_prefix)) and time.monotonic() < deadline:
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
