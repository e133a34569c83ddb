"""Decoding and preprocessing images in a pool of worker processes, so that the visual process's device loop only
batches ready pixel tensors through the tower.

A family whose model has `preprocessor()` (a picklable callable holding no weights, e.g. LLaVA's CLIP processor)
runs in worker processes; otherwise `model.preprocess` runs in threads of the visual process. Worker processes hand
their pixels back through shared memory (`visual.shared_pixels`), not through the result pipe. They are forked from
a fork server that imported everything they need once (`start_fork_server`, `visual.fork_server_preload`), and the
pool counts as started only when every one of them has warmed up.

A worker that dies (killed by the OOM killer or an operator) breaks a `ProcessPoolExecutor` for good: the images it
and the others held fail (`BrokenProcessPool`: the server answers 503, not the image's fault), and the next submit
starts a new pool from the same fork server, so the visual process goes on serving.
"""

from __future__ import annotations

import functools
import gc
import inspect
import io
import logging
import multiprocessing as mp
import os
import pickle
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver

import torch
from PIL import Image

from visual.hf_imports import skip_docstring_generation
from visual.image_decode import BadImage, open_image
from visual.models.base import ImageInput
from visual.pids import pid_alive
from visual.semaphore_names import use_multiprocessing_semaphore_names
from visual.shared_pixels import (
    STAGE_MIN_BYTES,
    SharedBytes,
    SharedPixels,
    discard,
    read_bytes,
    share_tensor,
    take_tensor,
)
from visual.shm_segments import list_segments, unlink_segment
from visual.spare_segments import SpareSegments

logger = logging.getLogger(__name__)

Preprocessor = Callable[[Image.Image], ImageInput]

# The decode limit inside the visual process: the HTTP process already checked each image against its own (lower)
# limit, this only guards against bytes that reach the queue some other way.
MAX_PIXELS = 256 * 1024 * 1024

_worker_preprocessor: Preprocessor | None = None
_all_started: threading.Barrier | None = None  # each worker's `_ready` waits here for all the others
_START_TIMEOUT_S = 120.0


class _Handoff:
    """What a worker takes when it starts, let go of after the starts: the executor keeps its initargs for life, and a
    barrier held to the end is a set of named semaphores that the visual process's os._exit leaves behind."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier: threading.Barrier | None = barrier
        self.visual_pid = os.getpid()


def _leave_with(pid: int) -> None:
    """Exit when process `pid` (the visual process) does, even if it is killed outright. Our parent is the fork
    server, and it lives as long as any of its children does, so the parent's death signal would never come."""

    def watch() -> None:
        try:
            pidfd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited
            select.select([pidfd], [], [])
        except (AttributeError, OSError):
            while pid_alive(pid):
                time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="leave-with-visual", daemon=True).start()


def _init_worker(pickled_preprocessor: bytes, handoff: _Handoff) -> None:
    global _worker_preprocessor, _all_started
    _all_started = handoff.barrier
    skip_docstring_generation()  # before unpickling imports the image processor's transformers modules
    _worker_preprocessor = pickle.loads(pickled_preprocessor)
    torch.set_num_threads(1)  # many workers side by side: one thread each, or their thread pools fight for cores
    # Ctrl-C, systemd and `docker stop` signal the whole process group: the server's parent decides when to stop,
    # and the visual process stops the pool (or this worker leaves with it).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _leave_with(handoff.visual_pid)
    # One tiny image through the whole path now: the image processor imports and sets up lazily (seconds of CPU in
    # each worker), which would otherwise land on the first requests the server serves.
    if _worker_preprocessor is not None:
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (127, 127, 127)).save(buf, "PNG")
        decode_and_preprocess(buf.getvalue())


def rgb_conversion(preprocessor: Preprocessor) -> str:
    """How a family's reference turns an image into RGB: "hf" (transformers' `convert_to_rgb`: transparency onto
    white) or "pil" (`image.convert("RGB")`). A preprocessor (or the model of a bound `preprocess`) may declare it as
    an `rgb_conversion` attribute; otherwise a preprocessor that wraps a transformers image processor which converts
    (`processor` / `image_processor` with `do_convert_rgb` not False) is "hf", except LLaVA's pad-to-square path
    (the original LLaVA code, which pads a `convert("RGB")` image), and anything else is "pil"."""
    for obj in (preprocessor, getattr(preprocessor, "__self__", None)):
        declared = getattr(obj, "rgb_conversion", None)
        if declared in ("hf", "pil"):
            return declared
    if getattr(preprocessor, "pad_to_square", False):
        return "pil"
    processor = getattr(preprocessor, "processor", None) or getattr(preprocessor, "image_processor", None)
    converts = getattr(processor, "do_convert_rgb", True) is not False
    if type(processor).__module__.startswith("transformers.") and converts:
        return "hf"
    return "pil"


def to_rgb(image: Image.Image, conversion: str) -> Image.Image:
    """`image` (frame 0 of it) in RGB, converted as `conversion` says (see `rgb_conversion`)."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    try:
        if conversion == "hf":
            return _hf_convert_to_rgb(image)
        return image.convert("RGB")
    except Exception as e:  # a mode PIL cannot convert (e.g. La)
        raise BadImage(f"cannot convert a {image.mode} image to RGB: {e}") from None


def _hf_convert_to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`, on a PIL image: newer versions return one only when not asked for an array
    (deprecated, with a warning), older ones have no `return_numpy` to ask with."""
    from transformers.image_transforms import convert_to_rgb

    if _takes_return_numpy(convert_to_rgb):
        return Image.fromarray(convert_to_rgb(image, return_numpy=True))
    return convert_to_rgb(image)


@functools.cache  # one signature to read per worker, not one per image
def _takes_return_numpy(function: Callable) -> bool:
    return "return_numpy" in inspect.signature(function).parameters


def decode_and_preprocess(
    data: bytes, preprocessor: Preprocessor | None = None, options: dict | None = None
) -> ImageInput:
    """Image file bytes -> the model's input; `options`: the request's keyword arguments for the preprocessor (a
    tiling family's `max_patches`). Raises BadImage if the bytes do not decode."""
    start = time.perf_counter()
    preprocessor = preprocessor or _worker_preprocessor
    image = to_rgb(open_image(data, MAX_PIXELS), rgb_conversion(preprocessor))
    decoded = time.perf_counter()
    out = preprocessor(image, **(options or {}))
    out.decode_s, out.preprocess_s = decoded - start, time.perf_counter() - decoded
    return out


def decode_video_and_preprocess(data: bytes, sampling: dict, preprocessor=None) -> ImageInput:
    """Video file bytes -> the model's input: the family's preprocessor's `video` (families that serve video, see
    families/spec.py) samples, decodes and preprocesses the frames. Raises BadImage (BadVideo) for a bad file."""
    start = time.perf_counter()
    out = (preprocessor or _worker_preprocessor).video(data, sampling)
    out.preprocess_s = time.perf_counter() - start  # decoding and preprocessing interleave in one call
    out.video = True
    return out


def _worker_task(
    data: bytes | SharedBytes, shm_prefix: str, video: dict | None = None, options: dict | None = None
) -> ImageInput:
    """In a worker process: the model input, its pixels left in a shared-memory segment."""
    if isinstance(data, SharedBytes):
        data = read_bytes(data)
    if video is None:
        out = decode_and_preprocess(data, None, options)
    else:
        out = decode_video_and_preprocess(data, video)
    out.pixel_values = share_tensor(out.pixel_values, shm_prefix)
    return out


def _ready(timeout_s: float) -> int:
    """The start task, one per worker: submitting it makes the pool start a worker, and it returns only once every
    worker runs one. A worker that finished starting first cannot take all of them (it is blocked in the first), so
    when all have returned, every worker has imported, unpickled and warmed up."""
    _all_started.wait(timeout_s)
    return os.getpid()


def start_fork_server() -> None:
    """Start the workers' fork server now: its imports (torch, transformers, every family's modules: seconds) go on
    beside the caller's own imports and tower load, instead of after them when the pool's first worker starts."""
    _fork_server_context()
    forkserver.ensure_running()


def _fork_server_context() -> mp.context.BaseContext:
    """Workers forked from a fresh server process that imported torch, transformers and the families' preprocessing
    once (`visual.fork_server_preload`). The visual process itself has CUDA initialised and must not be forked;
    spawned workers would each import all of it again (~5-15 CPU-s apiece), which on an 8-worker GPU host competed
    with the first requests."""
    use_multiprocessing_semaphore_names()  # the pool's queues and barrier: named after the server, not loky's way
    ctx = mp.get_context("forkserver")
    # __main__: as spawn would import it, here once for all workers. No effect once this process's server runs.
    ctx.set_forkserver_preload(["__main__", "visual.fork_server_preload"])
    return ctx


class PreprocessPool:
    def __init__(self, model, num_workers: int = 2, shm_prefix: str | None = None):
        """The model's picklable `preprocessor()` in worker processes, or with no workers its `preprocess` in
        threads."""
        if num_workers > 0:
            self._start_processes(model.preprocessor(), num_workers, shm_prefix)
        else:
            self._start_threads(model.preprocess, num_workers, shm_prefix, model.preprocessor())

    @classmethod
    def of_preprocessor(cls, preprocessor: Preprocessor, num_workers: int, shm_prefix: str | None = None):
        """A pool for a family's picklable preprocessor alone: no model needed, so its workers can start (seconds
        each) while the tower loads."""
        pool = cls.__new__(cls)
        if num_workers > 0:
            pool._start_processes(preprocessor, num_workers, shm_prefix)
        else:
            pool._start_threads(preprocessor, num_workers, shm_prefix)
        return pool

    def _start_processes(self, preprocessor: Preprocessor | None, num_workers: int, shm_prefix: str | None) -> None:
        self._preprocessor: Preprocessor | None = None
        # The server's prefix, so that its stop removes any pixel segment left behind.
        self._shm_prefix = shm_prefix or f"mmsv_px_{secrets.token_hex(4)}_"
        self._pickled = pickle.dumps(preprocessor)  # the preprocessor is unpickled after the worker's imports
        self._inputs: SpareSegments | None = SpareSegments(self._shm_prefix, count=2, tag="inspare")
        self._num_workers = num_workers
        self._handoff = _Handoff(_fork_server_context().Barrier(num_workers))
        self._executor: Executor = self._process_pool()
        # The pool starts workers on demand: start them all now, in the background (each warms up on a tiny image),
        # so the first images do not wait for workers to start and the image processor to load. From a thread: the
        # first start waits until the fork server has imported its modules (seconds), which the caller spends on
        # loading the tower meanwhile.
        self._starting: list[Future[int]] = []
        self._submitter = threading.Thread(
            target=lambda: self._starting.extend(
                self._executor.submit(_ready, _START_TIMEOUT_S) for _ in range(num_workers)
            ),
            name="preprocess-start",
            daemon=True,
        )
        self._submitter.start()

    def _process_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self._num_workers,
            mp_context=_fork_server_context(),
            initializer=_init_worker,
            initargs=(self._pickled, self._handoff),
        )

    def _start_threads(
        self, preprocess: Preprocessor, num_workers: int, shm_prefix: str | None, video_preprocessor=None
    ) -> None:
        self._preprocessor = preprocess
        self._video_preprocessor = video_preprocessor or preprocess  # the object whose `video` reads videos
        self._shm_prefix = shm_prefix or f"mmsv_px_{secrets.token_hex(4)}_"
        self._executor = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="preprocess")
        self._starting = []
        self._submitter = None
        self._handoff = None
        self._inputs = None  # threads read the bytes where they are

    def wait_started(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Block until every worker has started and warmed up (raises what a worker's start raised)."""
        deadline = time.monotonic() + timeout_s
        if self._submitter is not None:
            self._submitter.join(timeout_s)
            if self._submitter.is_alive():
                raise TimeoutError(f"preprocessing workers did not start within {timeout_s:.0f} s")
        for future in self._starting:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        self._let_go_of_the_barrier()

    def _let_go_of_the_barrier(self) -> None:
        """Every worker holds its own copy by now (or the pool is stopping); ours going unlinks its semaphores."""
        if self._handoff is not None:
            self._handoff.barrier = None

    def submit(self, data: bytes, video: dict | None = None, options: dict | None = None) -> Future[ImageInput]:
        """Decode + preprocess an image (`options`: the preprocessor's keyword arguments for it) or a video (with its
        sampling parameters) in the pool; pass the finished future to `collect` (once)."""
        if self._preprocessor is not None:
            if video is not None:
                return self._executor.submit(decode_video_and_preprocess, data, video, self._video_preprocessor)
            return self._executor.submit(decode_and_preprocess, data, self._preprocessor, options)
        staged = self._stage(data)
        try:
            try:
                future = self._executor.submit(_worker_task, staged or data, self._shm_prefix, video, options)
            except BrokenProcessPool:  # a worker died: what the pool held has failed; a new pool takes this image
                self._replace_broken_pool()
                future = self._executor.submit(_worker_task, staged or data, self._shm_prefix, video, options)
        except BaseException:
            if staged is not None:
                unlink_segment(staged.name)
            raise
        if staged is not None:  # the worker has read it (or never will): done, failed or cancelled
            future.add_done_callback(lambda _: self._inputs.unlink_later(staged.name))
        return future

    def _stage(self, data: bytes) -> SharedBytes | None:
        """A large file into a spare segment for its worker (see visual.shared_pixels), or None: through the pipe."""
        if len(data) < STAGE_MIN_BYTES:
            return None
        name = self._inputs.stage(data)
        return SharedBytes(name, len(data)) if name is not None else None

    def _replace_broken_pool(self) -> None:
        """The broken executor has already stopped its other workers and failed their futures; its workers here
        start on demand (each warms up in its start, as at first: about a second from the fork server)."""
        logger.warning("a preprocessing worker died: its images failed; starting a new pool of %d workers",
                       self._num_workers)  # fmt: skip
        broken, self._executor = self._executor, self._process_pool()
        broken.shutdown(wait=True)  # joins its stopped workers and drops its queues (their semaphores)
        # Pixels its workers had written for images that failed with it: nobody will take them.
        for name in list_segments(self._shm_prefix + "px"):
            if not pid_alive(int(name.removeprefix(self._shm_prefix + "px").split("_")[0])):
                unlink_segment(name)

    @staticmethod
    def collect(future: Future[ImageInput]) -> ImageInput:
        """The finished future's image with its pixels mapped in; raises what the worker raised."""
        image = future.result()
        if isinstance(image.pixel_values, SharedPixels):
            image.pixel_values = take_tensor(image.pixel_values)
        return image

    @staticmethod
    def drop(future: Future[ImageInput]) -> None:
        """A future whose image nobody will collect: free its segment once it finishes."""

        def free(f: Future[ImageInput]) -> None:
            if not f.cancelled() and f.exception() is None and isinstance(f.result().pixel_values, SharedPixels):
                discard(f.result().pixel_values)

        future.add_done_callback(free)

    def shutdown(self) -> None:
        """Stop the workers and wait for them (a task already running finishes; queued ones are cancelled). A
        process pool's queues hold POSIX semaphores registered with multiprocessing's resource tracker, unlinked
        only when the queues are collected: the visual process leaves by os._exit, which skips that, and the tracker
        warned about "leaked semaphore objects" at every stop. Joining the pool drops its queues; collect them now."""
        if self._submitter is not None:
            self._submitter.join()  # its submits must not meet a pool already shut down
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._inputs is not None:
            self._inputs.close()
        self._let_go_of_the_barrier()
        gc.collect()
