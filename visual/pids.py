"""Whether a process is still there, by pid (shared by the sweeps of dead servers' leftovers and the preprocessing
workers)."""

from __future__ import annotations

import os
import re


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie counts: its parent may still clean up after it)."""
    if pid <= 0:
        return True  # not a pid we can ask about: keep
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def dead_owners_entries(directory: str, owner: re.Pattern[str]) -> list[str]:
    """The names in `directory`, sorted, that `owner` matches with a pid (its first group) no longer running: what a
    server killed outright left there, named after its pid. [] when the directory cannot be read."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [name for name in sorted(names) if (m := owner.match(name)) is not None and not pid_alive(int(m.group(1)))]
