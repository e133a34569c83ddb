"""multiprocessing's own names for the semaphores a process makes: `<semprefix>-<random>`, where
`mmserve.launch.semaphores.name_semaphores_after` sets the prefix to the server's, so that a later start can sweep the
semaphores of a server killed outright.

joblib's loky backend replaces that naming for the whole process when it is imported
(`multiprocessing.synchronize.SemLock._make_name` becomes `/loky-<pid>-<random>`), and transformers imports it, through
scikit-learn, wherever scikit-learn is installed (the GPU image has it). The preprocessing pool's semaphores then bore
loky's names, and a SIGKILL of the server left them in /dev/shm for good. So the naming is put back before any is made.
"""

from __future__ import annotations

import multiprocessing.process
from multiprocessing import synchronize


def _multiprocessing_name() -> str:
    # As multiprocessing.synchronize.SemLock._make_name words it.
    return f"{multiprocessing.process.current_process()._config['semprefix']}-{next(synchronize.SemLock._rand)}"


def use_multiprocessing_semaphore_names() -> None:
    """Semaphores made from now on are named by this process's `semprefix`, whatever an import replaced."""
    synchronize.SemLock._make_name = staticmethod(_multiprocessing_name)
