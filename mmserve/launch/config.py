"""The server's configuration: built once from the command line, frozen, and handed to every process. Its options
are the engine's (language/options.py), the visual process's (visual/options.py) and the server's own, below;
mmserve/launch/cli.py makes the command line of all three."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from language.options import EngineOptions, option
from mmserve.http.reasoning_parsers import REASONING_PARSERS
from mmserve.http.tool_parsers import TOOL_CALL_PARSERS
from visual.options import VisualOptions

# Image caps. LightLLM's --max_image_pixels defaults to 3686400 (2560x1440) and downsizes larger images; here an
# image over the cap is refused with a 400, so the default is higher: 2**25 px takes 8K UHD frames and 24-30 MP
# camera photos (an RGB decode of at most 100 MB), and everything above it is refused before decoding.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 25
DEFAULT_MAX_IMAGES_PER_REQUEST = 16
# Video caps (per request): 768 frames is the Qwen2-VL video processor's own max_frames; 2**27 resized pixels is
# about 85k video tokens of Qwen2-VL, and 1.6 GB of float32 pixels in a preprocessing worker.
DEFAULT_MAX_VIDEO_BYTES = 32 << 20
DEFAULT_MAX_VIDEO_FRAMES = 768
DEFAULT_MAX_VIDEO_PIXELS = 1 << 27
DEFAULT_MAX_VIDEO_SECONDS = 600.0
DEFAULT_MAX_VIDEOS_PER_REQUEST = 4
DEFAULT_VIDEO_FPS = 2.0  # qwen-vl-utils' FPS, when neither the request nor the checkpoint's processor sets one


# Their --help groups (mmserve/launch/cli.py orders them)
_SERVING, _MODEL, _VISION, _PARALLEL, _LIMITS = "serving", "model", "vision", "parallelism", "limits and timeouts"


@dataclass(frozen=True)
class ServerConfig(EngineOptions, VisualOptions):
    # serving
    host: str = option("127.0.0.1", _SERVING, "address to serve HTTP on (a name binds every address it resolves to)")
    port: int = option(8000, _SERVING, "HTTP port")
    served_model_name: str | None = option(
        None, _SERVING, "model id in the OpenAI API; omitted: the model folder's name", aliases=("--served-model-name",)
    )
    chat_template: str | None = option(
        None, _SERVING, "a Jinja chat template file; omitted: the checkpoint's", aliases=("--chat-template",)
    )
    tool_call_parser: str | None = option(
        None,
        _SERVING,
        "the model's tool-call format, read into tool_calls (qwen25: Qwen2.5/Qwen3's <tool_call>; aliases qwen, "
        "hermes); needed for a required or named tool_choice; omitted: tool calls stay in the text",
        choices=sorted(TOOL_CALL_PARSERS),
        aliases=("--tool-call-parser",),
    )
    reasoning_parser: str | None = option(
        None,
        _SERVING,
        "the model's reasoning format, split into reasoning_content (qwen3: <think>...</think>); omitted: none",
        choices=sorted(REASONING_PARSERS),
        aliases=("--reasoning-parser",),
    )
    generation_config: str = option(
        "auto",
        _SERVING,
        "default sampling of the OpenAI routes (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), as "
        "vLLM's: auto: the checkpoint's generation_config.json; vllm: OpenAI's defaults; or a folder holding a "
        "generation_config.json",
        aliases=("--generation-config",),
    )
    override_generation_config: str | None = option(
        None,
        _SERVING,
        "a JSON object of generation-config fields set over --generation_config's, as vLLM's (e.g. "
        "'{\"temperature\": 0.5}'); omitted: none",
        aliases=("--override-generation-config",),
    )
    log_level: str = option(
        "info", _SERVING, "log level of every process", choices=["debug", "info", "warning", "error"]
    )
    tokenizer_workers: int = option(2, _SERVING, "threads that tokenize prompts (off the event loop)")
    # model
    model_dir: str | None = option(None, _MODEL, "HF checkpoint folder; omitted: a random-weight demo model")
    # vision
    enable_multimodal: bool = option(False, _VISION, "accept images (visual process + cache)")
    cache_capacity: int = option(200, _VISION, "images held in the embedding cache")
    allow_private_urls: bool = option(False, _VISION, "let image URLs resolve to loopback/private/link-local addresses")
    image_dir: str | None = option(
        None, _VISION, "directory from which image paths in prompts may be read; omitted: none"
    )
    # Per decode-only step, how long the router may hold back while the vision tower runs a batch (its turn on the
    # shared GPU, visual/tower_turn.py)
    tower_turn_ms: float = option(
        20.0,
        _VISION,
        "how long a decode-only step may wait while the vision tower runs a batch on the shared GPU (0: never)",
    )
    cuda_mps: str = option(
        "auto",
        _VISION,
        "run the vision tower's and the language model's processes as clients of a CUDA MPS daemon of the server's "
        "own, so that their kernels share the GPU instead of time-slicing (auto: where it applies: "
        "--enable_multimodal, --tp 1, an NVIDIA GPU, nvidia-cuda-mps-control on PATH; on: do not start without it; "
        "off: never); see docs/vision.md",
        choices=["auto", "on", "off"],
    )
    # parallelism: across hosts, LightLLM's flags: the ranks are spread evenly over nnodes hosts (host k runs ranks
    # [k * tp / nnodes, (k + 1) * tp / nnodes)), and meet at tcp://nccl_host:nccl_port (node 0's address).
    nnodes: int = option(1, _PARALLEL, "hosts the --tp ranks are spread over (tp / nnodes each)")
    node_rank: int = option(0, _PARALLEL, "this host's index; 0 serves HTTP, the others only ranks")
    nccl_host: str = option("127.0.0.1", _PARALLEL, "node 0's address, where the ranks meet")
    nccl_port: int = option(28765, _PARALLEL, "port on --nccl_host where the ranks meet")
    # LightLLM's data-parallel vision towers; one replicated tower (on GPU 0) is what we run
    visual_dp: int = option(1, _PARALLEL, "data-parallel vision towers (only 1: one tower)")
    # limits and timeouts
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS,
        _LIMITS,
        "most pixels (width * height) of one image, checked from its header before decoding; larger: a 400",
    )
    max_images_per_request: int = option(
        DEFAULT_MAX_IMAGES_PER_REQUEST, _LIMITS, "most images in one request; more: a 400"
    )
    max_videos_per_request: int = option(
        DEFAULT_MAX_VIDEOS_PER_REQUEST, _LIMITS, "most videos in one request; more: a 400"
    )
    max_video_bytes: int = option(
        DEFAULT_MAX_VIDEO_BYTES, _LIMITS, "most bytes of one video file (base64 payload decoded, or downloaded)"
    )
    max_video_seconds: float = option(
        DEFAULT_MAX_VIDEO_SECONDS, _LIMITS, "longest video (its container's duration); longer: a 400"
    )
    max_video_frames: int = option(
        DEFAULT_MAX_VIDEO_FRAMES, _LIMITS, "most frames sampled from the videos of one request; more: a 400"
    )
    max_video_pixels: int = option(
        DEFAULT_MAX_VIDEO_PIXELS,
        _LIMITS,
        "most pixels of the sampled frames of one request's videos, after the video processor's resize; more: a 400",
    )
    video_fps: float = option(
        DEFAULT_VIDEO_FPS,
        _VISION,
        "frames sampled per second of video when neither the request's mm_processor_kwargs nor the checkpoint's video "
        "processor sets fps or num_frames",
    )
    graceful_timeout: float = option(
        30.0, _LIMITS, "on SIGTERM/SIGINT: seconds in-flight requests may take to finish while new ones get 503"
    )
    request_read_timeout: float = option(
        60.0, _LIMITS, "seconds a request body may take to arrive in full; slower uploads get a 408 (0: no limit)"
    )
    stream_write_timeout: float = option(
        30.0,
        _LIMITS,
        "seconds a response may wait on a client that does not read; then the connection is dropped and the request "
        "aborted, freeing its KV slots (0: no limit)",
    )
    visual_max_restarts: int = option(
        3,
        _LIMITS,
        "restarts of a visual process that keeps dying (in a row, with backoff) before the server exits non-zero",
    )
    startup_timeout_s: float = 600.0  # model load limit for the child processes (no flag)

    def __post_init__(self) -> None:
        EngineOptions.__post_init__(self)
        VisualOptions.__post_init__(self)
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--nnodes must be >= 1 and --node_rank in 0..nnodes-1")
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} must be a multiple of --nnodes {self.nnodes} (the same ranks per host)")
        if not 0 < self.nccl_port < 65536:
            raise ValueError("--nccl_port must be in 1..65535")
        if self.visual_dp != 1:
            raise ValueError(
                "--visual_dp: data-parallel vision towers are not implemented; the vision tower runs once, in the "
                "visual process on the first GPU, and its embeddings reach every rank. Use --visual_dp 1"
            )
        self.generation_overrides()  # refused here, at start, in one line
        if self.cache_capacity < 1:
            raise ValueError("--cache_capacity must be >= 1")
        if self.max_image_pixels < 1:
            raise ValueError("--max_image_pixels must be >= 1")
        for name in ("max_video_bytes", "max_video_frames", "max_video_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.max_videos_per_request < 0:
            raise ValueError("--max_videos_per_request must be >= 0")
        if not (self.max_video_seconds > 0 and self.video_fps > 0):
            raise ValueError("--max_video_seconds and --video_fps must be > 0")
        if self.max_images_per_request < 1:
            raise ValueError("--max_images_per_request must be >= 1")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat_template: no such file {self.chat_template!r}")
        if self.graceful_timeout < 0:
            raise ValueError("--graceful_timeout must be >= 0")
        if self.request_read_timeout < 0 or self.stream_write_timeout < 0:
            raise ValueError("--request_read_timeout and --stream_write_timeout must be >= 0")
        if self.visual_max_restarts < 0:
            raise ValueError("--visual_max_restarts must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")

    def generation_overrides(self) -> dict:
        """--override_generation_config's JSON object ({} when omitted); ValueError, in one line, for anything else."""
        if self.override_generation_config is None:
            return {}
        try:
            overrides = json.loads(self.override_generation_config)
        except ValueError as e:
            raise ValueError(f"--override_generation_config is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--override_generation_config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
        return overrides

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this host runs (rank 0, the engine, is node 0's router process)."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def engine_config(self):
        """The language engine's config for this server (imported here: the HTTP process never builds one)."""
        from language.config import EngineConfig

        if self.model_dir is None:
            raise ValueError("model_dir is not set (the demo checkpoint is resolved before the engine starts)")
        engine_options = {f.name: getattr(self, f.name) for f in fields(EngineOptions)}
        return EngineConfig(
            **engine_options,
            model_dir=self.model_dir,
            dist_init_method=f"tcp://{self.nccl_host}:{self.nccl_port}",
            ranks_per_node=self.ranks_per_node,
        )
