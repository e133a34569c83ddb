"""The server's configuration: built once from the command line, frozen, and handed to every process."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from visual.attention_backend import VIT_ATT_BACKENDS

# LightLLM's --data_type spellings -> torch dtype names; "auto" keeps the checkpoint's own dtype.
DTYPE_NAMES = {
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "auto": "auto",
}

# Image caps. LightLLM's --max_image_pixels defaults to 3686400 (2560x1440) and downsizes larger images; here an
# image over the cap is refused with a 400, so the default is higher: 2**25 px takes 8K UHD frames and 24-30 MP
# camera photos (an RGB decode of at most 100 MB), and everything above it is refused before decoding.
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # what the engine and the vision tower run on

DEFAULT_MAX_IMAGE_PIXELS = 1 << 25
DEFAULT_MAX_IMAGES_PER_REQUEST = 16


@dataclass(frozen=True)
class ServerConfig:
    model_dir: str | None = None  # None: build and serve the random-weight demo checkpoint
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1  # tensor-parallel ranks (GPUs) over all hosts
    # Across hosts, LightLLM's flags: the ranks are spread evenly over nnodes hosts (host k runs ranks
    # [k * tp / nnodes, (k + 1) * tp / nnodes)), and meet at tcp://nccl_host:nccl_port (node 0's address).
    nnodes: int = 1
    node_rank: int = 0
    nccl_host: str = "127.0.0.1"
    nccl_port: int = 28765
    visual_dp: int = 1  # LightLLM's data-parallel vision towers; one replicated tower (on GPU 0) is what we run
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights from config.json (vLLM's)
    # KV cache slots; None sizes the cache from free device memory and mem_fraction.
    max_total_token_num: int | None = None
    mem_fraction: float = 0.9
    running_max_req_size: int = 1000
    max_req_total_len: int | None = None  # prompt + new tokens; None: the engine's limit
    eos_id: tuple[int, ...] | None = None  # overrides the checkpoint's EOS ids
    chunked_prefill_size: int = 4096  # prompt tokens prefilled per step
    chunked_prefill: bool = True  # --disable_chunked_prefill: whole prompts
    prefix_cache: bool = True  # --disable_dynamic_prompt_cache: no reuse of earlier prompts' KV
    graph_max_batch_size: int = 256  # largest decode batch captured as a CUDA graph
    cuda_graph: bool = True  # --disable_cudagraph: eager decode
    piecewise_cuda_graph_max_tokens: int = 1024  # prompt/mixed steps up to this size replay piecewise graphs
    trust_remote_code: bool = False
    enable_multimodal: bool = False
    cache_capacity: int = 200  # images held in the embedding cache
    data_type: str = "auto"  # torch dtype name, see DTYPE_NAMES
    device: str = "auto"
    # Our own flags
    allow_private_urls: bool = False  # image URLs may resolve to loopback/private addresses
    image_dir: str | None = None  # the only directory image paths inside a prompt may be read from
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height of one image, checked from its header
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    vision_tower_dir: str | None = None  # original LLaVA layout: the CLIP folder (instead of mm_vision_tower)
    served_model_name: str | None = None  # the model id of the OpenAI API; None: the model folder's name
    chat_template: str | None = None  # a Jinja chat template file that overrides the checkpoint's
    log_level: str = "info"
    tokenizer_workers: int = 2  # threads that tokenize (off the event loop)
    startup_timeout_s: float = 600.0  # model load limit for the child processes
    graceful_timeout: float = 30.0  # on SIGTERM: seconds in-flight requests may take to finish (LightLLM's name)
    request_read_timeout: float = 60.0  # seconds a request body may take to arrive in full (0: no limit)
    stream_write_timeout: float = 30.0  # seconds a response write may wait on a client that does not read (0: none)
    # Per decode-only step, how long the router may hold back while the vision tower runs a batch (its turn on the
    # shared GPU, visual/tower_turn.py); 0: never
    tower_turn_ms: float = 20.0
    visual_infer_batch_size: int = 16  # images per vision-tower batch (LightLLM's name)
    # Vision-tower positions (patches) per batch (0: no limit): a burst of large images goes through in small
    # batches, each image's embeddings reaching the LM when its own batch ends, not a 16-image batch's
    visual_batch_max_patches: int = 16384
    # How long a vision-tower batch that is not full waits for images still being preprocessed (0: never): a burst's
    # first images then go through in one batch, not one by one (visual/encoder.py, _wait_for_stragglers)
    visual_batch_wait_ms: float = 10.0
    vit_att_backend: str = "auto"  # the vision towers' attention kernel (LightLLM's flag): auto/triton, sdpa, ...
    visual_max_restarts: int = 3  # deaths of the visual process in a row it is restarted after; then the server exits

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError("--tp must be >= 1")
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
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"--device {self.device}: must be auto, cpu, cuda or cuda:<index>")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("--load_format must be auto or dummy")
        if self.max_total_token_num is not None and self.max_total_token_num < 1:
            raise ValueError("--max_total_token_num must be >= 1")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem_fraction must be in (0, 1]")
        if self.running_max_req_size < 1:
            raise ValueError("--running_max_req_size must be >= 1")
        if self.max_req_total_len is not None and self.max_req_total_len < 2:
            raise ValueError("--max_req_total_len must be >= 2")
        if self.data_type not in DTYPE_NAMES.values():
            raise ValueError(f"--data_type must be one of {sorted(DTYPE_NAMES)}")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked_prefill_size must be >= 1")
        if self.graph_max_batch_size < 1:
            raise ValueError("--graph_max_batch_size must be >= 1")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("--piecewise_cuda_graph_max_tokens must be >= 0")
        if self.cache_capacity < 1:
            raise ValueError("--cache_capacity must be >= 1")
        if self.max_image_pixels < 1:
            raise ValueError("--max_image_pixels must be >= 1")
        if self.max_images_per_request < 1:
            raise ValueError("--max_images_per_request must be >= 1")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat_template: no such file {self.chat_template!r}")
        if self.graceful_timeout < 0:
            raise ValueError("--graceful_timeout must be >= 0")
        if self.request_read_timeout < 0 or self.stream_write_timeout < 0:
            raise ValueError("--request_read_timeout and --stream_write_timeout must be >= 0")
        if self.visual_infer_batch_size < 1:
            raise ValueError("--visual_infer_batch_size must be >= 1")
        if self.visual_batch_wait_ms < 0:
            raise ValueError("--visual_batch_wait_ms must be >= 0")
        if self.visual_batch_max_patches < 0:
            raise ValueError("--visual_batch_max_patches must be >= 0")
        if self.vit_att_backend not in VIT_ATT_BACKENDS:
            raise ValueError(f"--vit_att_backend must be one of {', '.join(VIT_ATT_BACKENDS)}")
        if self.visual_max_restarts < 0:
            raise ValueError("--visual_max_restarts must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")

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
        return EngineConfig(
            model_dir=self.model_dir,
            max_total_token_num=self.max_total_token_num,
            mem_fraction=self.mem_fraction,
            running_max_req_size=self.running_max_req_size,
            max_req_total_len=self.max_req_total_len,
            dtype=self.data_type,
            device=self.device,
            eos_id=self.eos_id,
            trust_remote_code=self.trust_remote_code,
            chunked_prefill_size=self.chunked_prefill_size,
            chunked_prefill=self.chunked_prefill,
            prefix_cache=self.prefix_cache,
            cuda_graph=self.cuda_graph,
            cuda_graph_max_batch=self.graph_max_batch_size,
            piecewise_graph_max_tokens=self.piecewise_cuda_graph_max_tokens,
            tp=self.tp,
            dist_init_method=f"tcp://{self.nccl_host}:{self.nccl_port}",
            ranks_per_node=self.ranks_per_node,
            load_format=self.load_format,
        )
