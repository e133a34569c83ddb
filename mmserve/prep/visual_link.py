"""--enable_multimodal wiring: the visual process, the shared-memory embedding cache, and the HTTP side's link to
them (the pieces themselves live in visual/, cache/ and mmserve/prep/multimodal/).

    HTTP --EncodeJob--> visual --EncodeDone/EncodeFailed--> HTTP (CacheCoordinator)
    router: reads each image's embeddings from shared memory by key (cache.shm_store.ShmEmbedReader)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cache.coordinator import CacheCoordinator
from cache.shm_store import list_segments, unlink_segment
from families import family
from mmserve.ipc.endpoints import Endpoints
from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import parent_alive, run_child
from mmserve.prep.multimodal.image_io import ImagePolicy
from mmserve.prep.multimodal.preparer import MultimodalPreparer
from mmserve.prep.multimodal.url_fetch import FetchPolicy
from mmserve.prep.multimodal.video_io import VideoPolicy
from mmserve.prep.tokenization import MultimodalInput, PreparedPrompt, RunSync
from mmserve.prep.vision_timing import VisionTiming
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualReady
from visual.models.weights import read_json
from visual.options import VisualOptions
from visual.process import VisualProcessConfig, start_visual_process

logger = logging.getLogger(__name__)

# Threads that decode, check and hash request images. Decoding and hashing release the GIL, so this scales with the
# cores (the tokenizer pool, --tokenizer_workers, is 2 by default and also parses request bodies).
IMAGE_WORKERS = max(4, min(32, os.cpu_count() or 4))


def run_visual_process(cfg: VisualProcessConfig, ready: Connection) -> None:
    """The visual process: `visual.process.start_visual_process` inside the children's common plumbing (signals,
    logging, the ready handshake over `ready`, exiting with the parent)."""

    def start():
        info, serve_while = start_visual_process(cfg)
        return info, lambda parent_pid: serve_while(lambda: parent_alive(parent_pid))

    run_child("visual", cfg.log_level, ready, start)


def run_visual_child(config: ServerConfig, endpoints: Endpoints, shm_prefix: str, ready: Connection) -> None:
    """The visual process's entry (mmserve.launch.children.spawn_visual): its config is built here, in the child, so
    that the server's parent needs none of the visual package's imports to start it."""
    run_visual_process(visual_process_config(config, endpoints, shm_prefix), ready)


def visual_process_config(config: ServerConfig, endpoints: Endpoints, shm_prefix: str) -> VisualProcessConfig:
    visual_options = {f.name: getattr(config, f.name) for f in dataclasses.fields(VisualOptions)}
    return VisualProcessConfig(
        **visual_options,
        model_dir=config.model_dir,
        jobs_addr=endpoints.visual,
        results_addr=endpoints.visual_results,
        shm_prefix=shm_prefix,
        device=config.device,
        data_type=config.data_type,
        load_format=config.load_format,
        log_level=config.log_level,
    )


def load_prompt_processor(config: ServerConfig, tokenizer):
    """The family's prompt processor (HF's image processor inside: seconds of imports and files), for the
    checkpoint's `architectures[0]`; the server builds it while its children load."""
    spec = family(read_json(os.path.join(config.model_dir, "config.json"))["architectures"][0])
    processor = spec.part("prompt").from_pretrained(config.model_dir, tokenizer)
    if spec.images_in_prompt:  # Qwen-VL: paths inside <img></img> only from --image_dir
        processor.image_dir = config.image_dir
    return processor


class VisualLink:
    """The HTTP process's image support (an `ImagePreparer`): its sockets and the results task live on the event
    loop between start() and stop()."""

    def __init__(self, config: ServerConfig, endpoints: Endpoints, shm_prefix: str, ready: VisualReady, processor):
        """`processor`: load_prompt_processor's, built while the children start."""
        self.endpoints = endpoints
        self.coordinator = CacheCoordinator(config.cache_capacity, shm_prefix, send_job=self._send_job)
        self.timing = VisionTiming()
        policy = ImagePolicy(
            max_pixels=config.max_image_pixels,
            max_images=config.max_images_per_request,
            fetch=FetchPolicy(allow_private=config.allow_private_urls),
        )
        self.cache_salt = ready.cache_salt
        self._image_pool = ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="image")
        spec = family(ready.architecture)
        video_policy = VideoPolicy(
            max_videos=config.max_videos_per_request, max_bytes=config.max_video_bytes,
            max_seconds=config.max_video_seconds, max_frame_pixels=config.max_image_pixels,
            max_frames=config.max_video_frames, max_pixels=config.max_video_pixels, fps=config.video_fps,
        )  # fmt: skip
        self.preparer = MultimodalPreparer(
            processor, self.coordinator, ready.cache_salt, policy, self._image_pool,
            check_size=processor.check_image_size if spec.checks_image_size else None,
            images_in_prompt=spec.images_in_prompt, videos=spec.videos, video_policy=video_policy,
            encode_tiled=processor.encode_tiled if spec.tiles_images else None,
        )  # fmt: skip
        self._prefix_cache = config.prefix_cache  # what deferring an evicted image relies on
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    # ImagePreparer
    async def prepare(self, rid: str, request: MultimodalInput, run_sync: RunSync) -> PreparedPrompt:
        request = dataclasses.replace(request, defer=request.defer and self._prefix_cache)
        return await self.preparer.prepare(rid, request, run_sync)

    async def encode_deferred(self, rid: str) -> None:
        await self.preparer.encode_deferred(rid)

    def release(self, rid: str) -> None:
        self.preparer.release(rid)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._jobs = self._jobs_socket()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(self.endpoints.visual_results)
        self._task = asyncio.create_task(self._receive_results())

    def _jobs_socket(self) -> zmq.asyncio.Socket:
        jobs = self._ctx.socket(zmq.PUSH)
        jobs.setsockopt(zmq.LINGER, 0)
        jobs.setsockopt(zmq.SNDHWM, 0)  # never block the event loop; the cache bounds what is in flight
        jobs.connect(self.endpoints.visual)
        return jobs

    # the VisualSupervisor's callbacks
    def on_visual_down(self, reason: str) -> None:
        """The visual process died: jobs still queued for it are dropped with its socket (a restarted process
        must not encode keys the cache gave up on), and what it was encoding fails."""
        self._jobs.close()
        self._jobs = self._jobs_socket()
        self.coordinator.encoder_down(reason)

    def on_visual_up(self, ready: VisualReady) -> None:
        if ready.cache_salt != self.cache_salt:
            raise RuntimeError("the restarted visual process keys images differently (its cache salt changed)")
        for name in list_segments(self.coordinator.shm_prefix + "px"):  # the dead process's pixels in transit
            unlink_segment(name)
        self.coordinator.encoder_up()

    def degraded(self) -> str | None:
        return None  # the supervisor says so while the visual process is down

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._ctx is not None:
            self._jobs.close()
            self._results.close()
            self._ctx.term()
        self._image_pool.shutdown(wait=False, cancel_futures=True)
        await self.preparer.aclose()

    def _send_job(self, job: EncodeJob) -> None:
        self._jobs.send_multipart(job.frames(), flags=zmq.NOBLOCK, copy=False)

    async def _receive_results(self) -> None:
        while True:
            msg = pickle.loads(await self._results.recv())
            if isinstance(msg, (EncodeDone, EncodeFailed)):
                self.coordinator.on_result(msg)
                if isinstance(msg, EncodeDone):
                    self.timing.observe(msg)
            else:
                logger.error("HTTP server got a %s from the visual process; dropped", type(msg).__name__)

    # prometheus_client custom collector: registered into the server's registry
    def collect(self):
        m = self.coordinator.metrics()
        yield CounterMetricFamily(
            "mmserve_images_encoded", "Images run through the vision tower", value=m["mmserve_images_encoded_total"]
        )
        yield CounterMetricFamily(
            "mmserve_embed_cache_hits", "Images found in the embedding cache", value=m["mmserve_embed_cache_hits_total"]
        )
        yield CounterMetricFamily(
            "mmserve_images_encode_skipped",
            "Images seen before and evicted from the embedding cache since, not encoded again because the prefix "
            "cache held the KV of the prompt past them",
            value=self.preparer.encodes_skipped,
        )
        yield GaugeMetricFamily(
            "mmserve_embed_cache_items", "Images held in the embedding cache", value=m["mmserve_embed_cache_items"]
        )
        yield GaugeMetricFamily(
            "mmserve_embed_cache_items_in_use",
            "Images in the embedding cache that requests still hold (until their prefill ran or the router let go)",
            value=m["mmserve_embed_cache_items_in_use"],
        )
        yield from self.timing.collect()
