"""The preprocessing pool's worker processes: `wait_started` returns only when every worker is up, large files reach
them through shared memory, and the pool's stop leaves no semaphore or segment behind."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch
from PIL import Image

from cache.shm_store import list_segments, new_prefix
from visual.models.base import ImageInput
from visual.preprocess import PreprocessPool
from visual.shared_pixels import STAGE_MIN_BYTES


class SlowToStart:
    """A preprocessor whose unpickling (in each worker's start) is quick in the first worker and 1.5 s in the others:
    the quick one must not take every start task and report the pool ready on its own."""

    def __init__(self, marker: str):
        self.marker = marker

    def __getstate__(self) -> dict:
        return {"marker": self.marker}

    def __setstate__(self, state: dict) -> None:
        self.marker = state["marker"]
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))  # the first worker here
        except FileExistsError:
            time.sleep(1.5)

    def __call__(self, image) -> ImageInput:  # the workers' warm-up image
        return ImageInput(torch.zeros(3, image.height, image.width), num_tokens=1)


def test_wait_started_returns_once_every_worker_has_started(tmp_path):
    pool = PreprocessPool.of_preprocessor(SlowToStart(str(tmp_path / "first")), num_workers=3)
    try:
        pool.wait_started()
        assert len({f.result() for f in pool._starting}) == 3  # each start task ran in its own worker
    finally:
        pool.shutdown()


SCRIPT = textwrap.dedent(
    """
    import os, sys
    from visual.preprocess import PreprocessPool

    class Model:  # what the pool reads of a vision model: a picklable preprocessor factory
        @staticmethod
        def preprocessor():
            return None

    if __name__ == "__main__":
        pool = PreprocessPool(Model(), num_workers=2)
        pool._executor.submit(int).result()  # the workers are up
        pool.shutdown()
        sys.stderr.flush()
        os._exit(0)  # as the visual process leaves (mmserve.launch.processes.exit_now)
    """
)


def test_the_pool_stop_leaves_no_leaked_semaphores(tmp_path):
    """The visual process exits by os._exit (exit_now), which skips the finalizers that unlink the pool queues' POSIX
    semaphores, and multiprocessing's resource tracker then warned "There appear to be 5 leaked semaphore objects to
    clean up at shutdown" at every server stop."""
    script = tmp_path / "pool_stop.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    # communicate() reads stderr to its end: the resource tracker, which inherits it, has exited by then
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr


def test_the_fork_server_preload_imports_every_family_without_docstring_generation():
    """The fork server imports its preload modules and ignores any that fail, so a broken one would only show as
    slow workers: import it in a fresh interpreter, as the fork server does, and check what it leaves."""
    check = textwrap.dedent(
        """
        import importlib, sys
        import visual.fork_server_preload
        from families import FAMILIES
        d = importlib.import_module("transformers.utils.auto_docstring")  # the module, not the function of its name
        assert d.auto_class_docstring.__name__ == "_unchanged", d.auto_class_docstring
        towers = {spec.vision.partition(":")[0] for spec in FAMILIES if spec.vision}
        assert len(towers) >= 5 and towers <= set(sys.modules), towers - set(sys.modules)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr


class Pixels:
    """A preprocessor that returns the decoded image's pixels as they are."""

    def __call__(self, image) -> ImageInput:
        return ImageInput(torch.from_numpy(np.asarray(image).copy()), num_tokens=1)


def test_large_files_reach_their_worker_through_a_spare_segment(tmp_path):
    """A file over STAGE_MIN_BYTES is copied into a spare segment for its worker (not pickled through the pool's
    pipe): the worker decodes the same bytes, and no staged segment outlives its image or the pool."""
    prefix = new_prefix()
    pool = PreprocessPool.of_preprocessor(Pixels(), num_workers=1, shm_prefix=prefix)
    try:
        pool.wait_started()
        pixels = [torch.randint(0, 256, (600 + i, 700, 3), dtype=torch.uint8) for i in range(3)]
        files = [_png(p) for p in pixels]
        assert all(len(f) >= STAGE_MIN_BYTES for f in files)
        for i, (data, expected) in enumerate(zip(files, pixels, strict=True)):
            if i == 1:  # the first told the pool the size: spares are made for the next ones
                _wait_for(lambda: len(list_segments(prefix + "inspare")) == 2)
            image = PreprocessPool.collect(pool.submit(data))
            assert torch.equal(image.pixel_values, expected)
        assert pool._inputs.taken == 2  # the second and the third
        _wait_for(lambda: len(list_segments(prefix)) == 2)  # the spares for the next: nothing else stays
    finally:
        pool.shutdown()
    assert list_segments(prefix) == []


def _png(pixels: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
