"""The visual-encoder process: loads the family's vision model on its device, then serves encode jobs from the HTTP
process until its parent goes away.

    jobs:    HTTP --EncodeJob--> visual  (zmq PULL, bound here at `jobs_addr`)
    results: visual --EncodeDone/EncodeFailed--> HTTP  (zmq PUSH, connects to `results_addr`)

`start_visual_process` loads it; the server runs it as a child process (`mmserve.prep.visual_link.run_visual_process`,
spawned like the other children), whose ready payload is a `VisualReady` (the HTTP process keys the cache with its
`cache_salt`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from PIL import Image

from families import all_families, family
from visual.attention_backend import set_vit_att_backend
from visual.encoder import VisualEncoder
from visual.messages import EncodeJob, VisualReady
from visual.models.base import vision_model_class
from visual.models.fp8_linear import quantize_tower
from visual.models.weights import read_json
from visual.options import VisualOptions
from visual.preprocess import PreprocessPool, start_fork_server
from visual.tower_turn import TowerTurn

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # longest sleep of the loop (it must wake to log stats and to notice its parent is gone)
_RECV_POLL_MS = 200  # the receiving thread's poll, so that it notices the stop
_STATS_LOG_S = 5.0  # how often a busy visual process logs its per-phase timing (as the router logs throughput)


@dataclass(frozen=True, kw_only=True)
class VisualProcessConfig(VisualOptions):
    """The visual process's options and where it runs; device, data_type, load_format and log_level are the
    engine's and the server's options, passed on."""

    model_dir: str
    jobs_addr: str
    results_addr: str
    shm_prefix: str
    device: str  # "auto": cuda if available, else cpu
    data_type: str  # torch dtype name; "auto": the checkpoint's (float32 on cpu)
    load_format: str  # dummy: the tower's random init, no weights read (families that support it)
    log_level: str
    # decode + preprocess runs on CPU: enough workers that it keeps up with the GPU (2 on a 2-core machine)
    num_preprocess_workers: int = max(2, min(8, (os.cpu_count() or 2) // 2))


def resolve_device_dtype(cfg: VisualProcessConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.data_type != "auto":
        return device, getattr(torch, cfg.data_type)
    if device.type == "cpu":
        return device, torch.float32
    raw = read_json(f"{cfg.model_dir}/config.json")
    name = raw.get("torch_dtype") or raw.get("dtype") or raw.get("text_config", {}).get("torch_dtype") or "float16"
    return device, getattr(torch, name)


def load_encoder(cfg: VisualProcessConfig) -> tuple[VisualEncoder, VisualReady]:
    if cfg.num_preprocess_workers > 0:
        start_fork_server()  # the workers' imports (seconds of start-up) run beside ours
    architecture = read_json(f"{cfg.model_dir}/config.json")["architectures"][0]
    device, dtype = resolve_device_dtype(cfg)
    extra = {"vision_tower_dir": cfg.vision_tower_dir} if cfg.vision_tower_dir else {}
    spec = family(architecture)
    cls = vision_model_class(architecture)
    set_vit_att_backend(cfg.vit_att_backend)  # before the tower is built: its attention layers read it
    if cfg.load_format == "dummy":
        if not spec.dummy_vision_weights:
            random_towers = [s.name for s in all_families() if s.dummy_vision_weights]
            raise ValueError(f"--load_format dummy: {architecture}'s vision tower needs its weights (only these "
                             f"families build a random tower: {', '.join(random_towers)})")  # fmt: skip
        extra["dummy"] = True
    phases = StartPhases()
    pool = None
    if cfg.num_preprocess_workers > 0:
        # Its workers take longer to start than the tower to load: they start first, and both go on together.
        preprocessor = cls.load_preprocessor(cfg.model_dir, cfg.vision_tower_dir)
        pool = PreprocessPool.of_preprocessor(preprocessor, cfg.num_preprocess_workers, cfg.shm_prefix)
        phases.done("preprocessor")
    model = cls.from_pretrained(cfg.model_dir, device, dtype, **extra)
    if cfg.vit_quant_type == "fp8w8a8":
        swapped = quantize_tower(model.tower)
        model.cache_salt = json.dumps([model.cache_salt, "vit fp8w8a8"])  # its embeddings are not the bf16 tower's
        logger.info("vision tower: %d encoder-layer linears in FP8 e4m3", swapped)
    phases.done("tower built and loaded")
    pool = pool or PreprocessPool(model, cfg.num_preprocess_workers, cfg.shm_prefix)
    graphs = use_tower_graphs(model, device, cfg.visual_cuda_graph_max_patches)
    warm = warm_up_tower(model, device, cfg.visual_infer_batch_size, graphs)  # while the pool's workers start
    phases.done("warm-up")
    pool.wait_started()  # ready means the first image is served at full speed
    phases.done(f"{cfg.num_preprocess_workers} preprocessing workers")
    logger.info("start-up: %s", phases)
    turn = None
    if device.type == "cuda":  # the GPU it shares with the router (on CPU each process has its own cores)
        turn = TowerTurn(cfg.shm_prefix)
        turn.create()
    encoder = VisualEncoder(
        model, pool, cfg.shm_prefix, cfg.visual_infer_batch_size, turn, cfg.visual_batch_max_patches,
        cfg.visual_batch_wait_ms / 1e3, cfg.tower_lookahead_tokens,
    )  # fmt: skip
    encoder.warm_up(warm)
    dtype_name = str(dtype).removeprefix("torch.")
    ready = VisualReady(architecture, model.cache_salt, model.hidden_size, str(device), dtype_name)
    return encoder, ready


class StartPhases:
    """Seconds spent in each start-up phase, for one log line (start-up has a 30 s budget; this says where it went)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._phases: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self._phases.append((name, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self._phases)


def use_tower_graphs(model, device: torch.device, max_patches: int) -> bool:
    """Turn on CUDA graphs for the tower's small batches (`visual/tower_graphs.py`) where they apply: on CUDA, with
    --visual_cuda_graph_max_patches above 0, for the families that have them (the Qwen2-VL generations' towers,
    whose inputs all derive from the image grids). Gemma 3's, InternVL's, LLaVA's and Qwen-VL's towers stay eager."""
    enable = getattr(model, "enable_cuda_graphs", None)
    if device.type != "cuda" or max_patches == 0 or enable is None:
        return False
    enable(max_patches)
    return True


# With graphs on, a lone image of each of these sides (LLaVA's 336 px and a common large one) gets its graph at
# start-up, so that the first request of that size already replays it.
_GRAPH_WARM_SIDES = (336, 896)


def warm_up_tower(model, device: torch.device, max_batch: int, graphs: bool = False) -> list[torch.Tensor]:
    """A batch through the tower and projector, its embeddings returned for `VisualEncoder.warm_up`: the first call
    loads the kernels and sets up the libraries (about a second on a GPU), which would otherwise land on the first
    image served. On a GPU the batch is a full one of 336 px images (LLaVA's size, a common small one): otherwise the
    first batch of each larger size would pay for pinning a bigger staging buffer, for new allocator segments and for
    loading GEMM kernels, tens of ms a batch, one after another in the first load after a start. On CPU one small
    image does."""
    gray = Image.new("RGB", (64, 64), (127, 127, 127))
    if device.type != "cuda":
        return model.encode([model.preprocess(gray)])
    out = model.encode([model.preprocess(gray.resize((336, 336)))] * max_batch)
    for side in _GRAPH_WARM_SIDES if graphs else ():
        image = model.preprocess(gray.resize((side, side)))
        for _ in range(2):  # the second sighting of its grid captures (within --visual_cuda_graph_max_patches)
            model.encode([image])
    torch.cuda.synchronize()
    return out


def serve(encoder: VisualEncoder, jobs: zmq.Socket, results: zmq.Socket, alive) -> None:
    """Jobs are received on their own thread and go straight into the preprocessing pool, so the pool keeps working
    while a batch runs through the tower. This loop sleeps until a job arrives or an image is preprocessed (no fixed
    waits), then encodes everything that is ready as one batch (continuous batching)."""
    stop = threading.Event()
    receiver = threading.Thread(target=_receive_jobs, args=(encoder, jobs, stop), name="visual-jobs", daemon=True)
    receiver.start()
    last_log, logged = time.monotonic(), encoder.stats.copy()
    try:
        while alive() and receiver.is_alive():
            encoder.wait_for_work(_IDLE_POLL_S)
            for result in encoder.step():
                results.send(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            now = time.monotonic()
            if now - last_log >= _STATS_LOG_S:
                if encoder.stats != logged:  # quiet while idle
                    logger.info("%s", encoder.stats.summary(logged, now - last_log))
                last_log, logged = now, encoder.stats.copy()
    finally:
        stop.set()
        receiver.join()


def _receive_jobs(encoder: VisualEncoder, jobs: zmq.Socket, stop: threading.Event) -> None:
    """The jobs socket's only user: read each EncodeJob and hand it to the pool at once."""
    while not stop.is_set():
        if not jobs.poll(_RECV_POLL_MS):
            continue
        while True:
            try:
                frames = jobs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                job = EncodeJob.from_frames(frames)
            except ValueError as e:
                logger.error("visual process got a message that is not an EncodeJob (%s); dropped", e)
                continue
            encoder.submit(job)


def start_visual_process(cfg: VisualProcessConfig) -> tuple[VisualReady, Callable[[Callable[[], bool]], None]]:
    """Load the encoder and open the sockets: the ready payload, and the loop that serves jobs while `alive()`
    holds. The process plumbing around it (signals, logging, the ready handshake, exiting with the parent) is the
    server's: `mmserve.prep.visual_link.run_visual_process`."""
    encoder, info = load_encoder(cfg)
    if info.device.startswith("cuda"):
        torch.set_num_threads(1)  # its CPU work is in the pool; spare threads would only contend with the router
    ctx = zmq.Context()
    jobs, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (jobs, results):
        sock.setsockopt(zmq.LINGER, 0)
    jobs.bind(cfg.jobs_addr)
    results.connect(cfg.results_addr)
    logger.info("vision model %s loaded on %s (%s)", info.architecture, info.device, info.dtype)

    def serve_while(alive: Callable[[], bool]) -> None:
        try:
            serve(encoder, jobs, results, alive)
        finally:
            encoder.shutdown()
            jobs.close()
            results.close()
            ctx.term()

    return info, serve_while
