"""A real mmserve server in a subprocess, for end-to-end tests: a free port on 127.0.0.1, its log in a file, and
checks that every process it started is gone after it stops.

The servers run on the CPU unless `MMSERVE_E2E_DEVICE` names another device (`cuda` on a GPU host: the same tests
then reach the Triton kernels, CUDA graphs and the overlapped loop that serve in production); a test that passes its
own `--device` keeps it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

E2E_DEVICE = os.environ.get("MMSERVE_E2E_DEVICE", "cpu")  # the device the servers run on (module docstring)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (no psutil)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the parenthesised command name
        if ppid == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    found = child_pids(pid)
    for child in list(found):
        found += descendants(child)
    return found


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of the Prometheus text format: name -> value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values


class ServerProcess:
    def __init__(
        self, model_dir: str | None, log_path: str, *args: str, env: dict | None = None, new_session: bool = False
    ):
        """model_dir None: the server builds and serves its demo checkpoint. `new_session`: the server leads its own
        process group, so that a test can signal the whole group (os.killpg) as systemd and docker do."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        model = ["--model_dir", model_dir] if model_dir else []
        cmd = [
            sys.executable,
            "-m",
            "mmserve.api_server",
            *model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            E2E_DEVICE,
            "--log_level",
            "warning",
            *args,
        ]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
        self.children: list[int] = []

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self.children = child_pids(self.proc.pid)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5.0).text)

    def wait_metric(self, name: str, predicate, timeout_s: float = 15.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics()[name]
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._log.close()
        return code

    def leftover_children(self, grace_s: float = 5.0) -> list[str]:
        """Children of the (stopped) server still running after `grace_s`, as "pid: command line"."""
        deadline = time.monotonic() + grace_s
        while (alive := [pid for pid in self.children if pid_alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [f"{pid}: {_cmdline(pid)}" for pid in alive]

    def stop_cleanly(self) -> None:
        """Stop it (SIGTERM) and check it left nothing: exit code 0, no child process, no shared-memory segment."""
        assert self.stop() == 0, self.log()
        assert self.leftover_children() == []
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{self.proc.pid}_")]


@contextlib.contextmanager
def serving(srv: ServerProcess) -> Iterator[ServerProcess]:
    """A module fixture's server: healthy on entry, stopped cleanly (`ServerProcess.stop_cleanly`) on exit."""
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop_cleanly()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
