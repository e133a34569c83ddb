"""The POSIX named semaphores of multiprocessing (/dev/shm/sem.*: the locks of a process pool's queues, a Barrier),
named after the server that made them, so that a later start removes those of a server killed outright.

multiprocessing names them `/mp-<random>` and unlinks them through its resource tracker, which a SIGKILL of the
whole process group kills too: nothing then tells whose they were. Every process of a server makes its semaphores
under `/mp-mmsv_<pid of the server>` instead (`name_semaphores_after`), and `remove_dead_semaphores` unlinks those
of a pid no longer running, as cache.shm_store.remove_dead_segments does for the embedding segments."""

from __future__ import annotations

import multiprocessing.process
import os
import re

from visual.pids import dead_owners_entries
from visual.semaphore_names import use_multiprocessing_semaphore_names

_SEM_DIR = "/dev/shm"  # where glibc keeps a named semaphore `/name`, as the file `sem.name`
_OWNER = re.compile(r"sem\.mp-mmsv_(\d+)-")


def name_semaphores_after(server_pid: int) -> None:
    """Semaphores this process makes from now on are named `/mp-mmsv_<server_pid>-<random>`. multiprocessing reads
    the prefix from the process's config each time it names one (synchronize.SemLock._make_name)."""
    multiprocessing.process.current_process()._config["semprefix"] = f"/mp-mmsv_{server_pid}"
    use_multiprocessing_semaphore_names()  # and again wherever semaphores are made: an import may replace it


def remove_dead_semaphores(sem_dir: str = _SEM_DIR) -> list[str]:
    """Unlink the semaphores of mmserve servers no longer running; returns their file names. A live server's,
    another user's and any not named by name_semaphores_after stay. Processes that still hold one open (none, once
    its server is gone) keep using it: unlinking only removes the name."""
    removed = []
    for name in dead_owners_entries(sem_dir, _OWNER):
        path = os.path.join(sem_dir, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(name)
    return removed
