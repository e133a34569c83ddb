"""The demo checkpoints served when no --model_dir is given, built once and cached: a tiny random-weight Llama, or
with --enable_multimodal a tiny random-weight Qwen2-VL in the published layout (tokenizer with Qwen2-VL's special
tokens and chat template, image processor files), so a newcomer can try images with nothing downloaded."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Where the demos are cached; tests point it at a temp dir so that nothing lands in the user's home.
DEMO_DIR_ENV = "MMSERVE_DEMO_DIR"


@dataclass(frozen=True)
class Demo:
    version: str  # the cache folder's name: bump it when the builder's output changes, so old caches are not reused
    description: str  # for the start-up warning
    build: Callable[[str], object]


def _build_llama(out_dir: str) -> None:
    from mmserve.testing.checkpoints.llama import build_llama

    build_llama(out_dir, shape="tiny", num_shards=None)


def _build_qwen2_vl(out_dir: str) -> None:
    from mmserve.testing.checkpoints.qwen2_vl_demo import build_qwen2_vl_demo

    build_qwen2_vl_demo(out_dir)


TEXT_DEMO = Demo("llama-tiny-v1", "a tiny Llama", _build_llama)
MULTIMODAL_DEMO = Demo("qwen2-vl-tiny-v1", "a tiny Qwen2-VL (published layout, accepts images)", _build_qwen2_vl)


def demo_for(multimodal: bool) -> Demo:
    return MULTIMODAL_DEMO if multimodal else TEXT_DEMO


def demo_root() -> str:
    """$MMSERVE_DEMO_DIR, else $XDG_CACHE_HOME/mmserve/demo, else ~/.cache/mmserve/demo."""
    if root := os.environ.get(DEMO_DIR_ENV):
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mmserve", "demo")


def demo_dir(multimodal: bool = False) -> str:
    return os.path.join(demo_root(), demo_for(multimodal).version)


def ensure_demo_checkpoint(path: str | None = None, multimodal: bool = False) -> str:
    """Build the demo checkpoint unless it is already there; the build goes to a temp dir first and is renamed
    into place, so an interrupted build never leaves a half-written checkpoint behind."""
    demo = demo_for(multimodal)
    path = path or demo_dir(multimodal)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    logger.info("building the demo checkpoint (%s) in %s, once", demo.description, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(path))
    try:
        demo.build(tmp)
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "config.json")):  # not a concurrent build that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the demo checkpoint in %s", path)
    return path
