"""Progress of long start-up phases (weight loading, CUDA-graph capture, warm-up): a tqdm bar when stderr is a
terminal, otherwise a log line every few seconds and one at the end, so server logs show where start-up is."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
_LOG_EVERY_S = 5.0


def progress(items: Iterable[T], total: int, desc: str, logger: logging.Logger) -> Iterator[T]:
    """Yield `items`, reporting how many of `total` are done under the name `desc`."""
    if sys.stderr.isatty():
        yield from tqdm(items, total=total, desc=desc, leave=False)
        return
    t0 = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= _LOG_EVERY_S:
            logger.info("%s: %d/%d (%.0f s)", desc, done, total, now - t0)
            last = now
    logger.info("%s: %d/%d done in %.1f s", desc, done, total, time.perf_counter() - t0)
