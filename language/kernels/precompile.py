"""Compiling Triton kernels in parallel, before they are first launched.

On a machine whose Triton cache is cold, each kernel variant takes about a second to compile, one after another
as the first decode graph meets them: most of the capture's time at start-up. Inside `compile_only()`, every Triton
launch only submits its kernel's compilation to a thread pool (Triton's AsyncCompileMode) and runs nothing; torch
operations still run. Running a forward inside it therefore compiles every variant that forward needs at once, and
the real runs afterwards find them compiled. Compilation spends most of its time outside the GIL (LLVM, ptxas), so
the threads overlap.

The outputs of a forward inside `compile_only()` are garbage (no kernel wrote them): use it only for runs whose
results are thrown away, such as the warm-up before a graph capture.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from triton.runtime.jit import JITFunction

logger = logging.getLogger(__name__)

try:  # Triton >= 3.4
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # pragma: no cover - older Triton compiles lazily, one kernel at a time
    AsyncCompileMode = None


_compiling_only = False  # inside compile_only(): Triton launches compile and run nothing


def available() -> bool:
    return AsyncCompileMode is not None


def compiling_only() -> bool:
    """Whether Triton launches only compile now (inside `compile_only()`): a launcher whose integer outputs torch then
    indexes with (sampled token ids) must fill them with something valid itself."""
    return _compiling_only


def _compile_launch(self: JITFunction, grid):
    return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)


@contextmanager
def compile_only(what: str, workers: int | None = None) -> Iterator[None]:
    """Within the block, Triton launches compile (in `workers` threads) and do not run; on exit every compile
    has finished. A no-op context where Triton has no AsyncCompileMode."""
    if AsyncCompileMode is None:
        yield
        return
    global _compiling_only
    workers = workers or max(2, min(16, os.cpu_count() or 2))
    t0 = time.perf_counter()
    launch = JITFunction.__getitem__
    JITFunction.__getitem__ = _compile_launch  # the class's launcher, for the duration of the block
    _compiling_only = True
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool, AsyncCompileMode(pool) as mode:
            yield
            submitted = len(mode.raw_futures)
    finally:
        JITFunction.__getitem__ = launch
        _compiling_only = False
    logger.info("%s: %d Triton kernel variant(s) compiled in %.1f s", what, submitted, time.perf_counter() - t0)
