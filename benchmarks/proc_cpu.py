"""CPU seconds per process of a server during a load, read from /proc (Linux), to show which process bounds it:
a process whose CPU seconds come near the load's wall time is saturated (one Python process = one core).

The server's processes are found by session id: serve_bench starts mmserve with `start_new_session=True`, so the
server's pid is the session id of all its children (router, detokenizer, visual process, preprocessing pool)."""

from __future__ import annotations

import os
from collections import Counter

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ... utime stime": comm may hold spaces, so split after its ')'.
    return text[text.rindex(")") + 2 :].split()


def session_cpu(session: int) -> Counter[str]:
    """{comm: utime + stime seconds} summed over the live processes of `session` (threads included); the session
    leader, mmserve's HTTP process, is "main(http)"; preprocessing workers show as "python"."""
    cpu: Counter[str] = Counter()
    if not os.path.isdir("/proc"):
        return cpu
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(pid)
        if fields is None or int(fields[3]) != session:  # fields[3]: session id
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(pid) == session:
            comm = "main(http)"  # the launcher: mmserve's HTTP process
        cpu[comm] += (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    return cpu


def cpu_delta(before: Counter[str], after: Counter[str]) -> dict[str, float]:
    """Seconds each process name used between two snapshots, busiest first (names of exited processes drop out)."""
    delta = {name: round(after[name] - before.get(name, 0.0), 2) for name in after}
    return dict(sorted(((k, v) for k, v in delta.items() if v > 0.005), key=lambda kv: -kv[1]))
