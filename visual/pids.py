"""Whether a process is still there, by pid (shared by the shared-memory sweep and the preprocessing workers)."""

from __future__ import annotations

import os


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
