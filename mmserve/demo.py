"""The demo checkpoint served when no --model_dir is given: a tiny random-weight Llama, built once and cached."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

_VERSION = "llama-tiny-v1"  # bump when the builder's output changes


def demo_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mmserve", "demo", _VERSION)


def ensure_demo_checkpoint(path: str | None = None) -> str:
    """Build the demo checkpoint unless it is already there; the build goes to a temp dir first and is renamed
    into place, so an interrupted build never leaves a half-written checkpoint behind."""
    path = path or demo_dir()
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from mmserve.checkpoints.llama import build_llama

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(path))
    try:
        build_llama(tmp, shape="tiny", num_shards=None)
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "config.json")):  # not a concurrent build that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the demo checkpoint in %s", path)
    return path
