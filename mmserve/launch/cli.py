"""Command-line flags (LightLLM's names, so its launch lines work unchanged) -> a frozen ServerConfig."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mmserve.launch.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES_PER_REQUEST, DTYPE_NAMES, ServerConfig
from visual.attention_backend import VIT_ATT_BACKENDS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not the usage of every flag (dozens of lines, the error last), then exit 2 as argparse does."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mmserve", description="Serve a (multimodal) LLM over HTTP, LightLLM-style.")
    p.add_argument("--model_dir", default=None, help="HF checkpoint folder; omitted: a random-weight demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree: GPUs the model is split over")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the --tp ranks are spread over (tp / nnodes each)")
    p.add_argument("--node_rank", type=int, default=0, help="this host's index; 0 serves HTTP, the others only ranks")
    p.add_argument("--nccl_host", default="127.0.0.1", help="node 0's address, where the ranks meet")
    p.add_argument("--nccl_port", type=int, default=28765, help="port on --nccl_host where the ranks meet")
    p.add_argument("--visual_dp", type=int, default=1, help="data-parallel vision towers (only 1: one tower)")
    p.add_argument(
        "--load_format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights built on the device from config.json alone (benchmarks; no weight files read)",
    )
    p.add_argument(
        "--max_total_token_num",
        type=int,
        default=None,
        help="KV cache token slots; omitted: sized from free memory and --mem_fraction",
    )
    p.add_argument("--mem_fraction", type=float, default=0.9, help="share of free device memory for weights + KV")
    p.add_argument("--running_max_req_size", type=int, default=1000, help="most requests decoding at once")
    p.add_argument("--max_req_total_len", type=int, default=None, help="most tokens of prompt + output per request")
    p.add_argument(
        "--chunked_prefill_size",
        type=int,
        default=4096,
        help="prompt tokens prefilled per step; longer prompts are split across steps beside decoding requests",
    )
    p.add_argument("--disable_chunked_prefill", action="store_true", help="prefill whole prompts, one step each")
    p.add_argument(
        "--disable_dynamic_prompt_cache",
        action="store_true",
        help="turn off the prefix cache (reuse of the KV of earlier prompts, images and answers)",
    )
    p.add_argument("--graph_max_batch_size", type=int, default=256, help="largest decode batch run as a CUDA graph")
    p.add_argument("--disable_cudagraph", action="store_true", help="run every step eagerly")
    p.add_argument(
        "--piecewise_cuda_graph_max_tokens",
        type=int,
        default=1024,
        help="prompt and mixed steps of up to this many tokens replay CUDA graphs of their dense parts, attention "
        "eager (SGLang's piecewise graphs); 0: eager",
    )
    p.add_argument("--eos_id", type=int, nargs="+", default=None, help="end-of-sequence ids (overrides the model's)")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--enable_multimodal", action="store_true", help="accept images (visual process + cache)")
    p.add_argument("--cache_capacity", type=int, default=200, help="images held in the embedding cache")
    p.add_argument("--data_type", choices=sorted(DTYPE_NAMES), default="auto")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument(
        "--allow_private_urls",
        action="store_true",
        help="let image URLs resolve to loopback/private/link-local addresses",
    )
    p.add_argument(
        "--tower_turn_ms",
        type=float,
        default=20.0,
        help="how long a decode-only step may wait while the vision tower runs a batch on the shared GPU (0: never)",
    )
    p.add_argument("--visual_infer_batch_size", type=int, default=16, help="most images in one vision-tower batch")
    p.add_argument(
        "--visual_batch_max_patches",
        type=int,
        default=16384,
        help="most patches (vision-tower positions) in one vision-tower batch, so large images go through in small "
        "batches and reach the LM sooner; a larger image runs alone (0: no limit)",
    )
    p.add_argument(
        "--visual_batch_wait_ms",
        type=float,
        default=10.0,
        help="how long a vision-tower batch that is not full waits for images still being preprocessed, so that a "
        "burst's first images go through in one batch, not one by one (0: never)",
    )
    p.add_argument(
        "--vit_att_backend",
        nargs="+",
        choices=list(VIT_ATT_BACKENDS),
        default=["auto"],
        help="vision-tower attention (LightLLM's flag): auto and triton: ours (visual/kernels/varlen_attention.py) "
        "where it applies, torch's flash elsewhere; sdpa: torch's flash/SDPA only; fa3 and xformers (not bundled) "
        "mean auto. One value per visual data-parallel tower: only one tower here",
    )
    p.add_argument("--image_dir", default=None, help="directory from which image paths in prompts may be read")
    p.add_argument(
        "--max_image_pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="most pixels (width * height) of one image, checked from its header before decoding; larger: a 400",
    )
    p.add_argument(
        "--max_images_per_request",
        type=int,
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        help="most images in one request; more: a 400",
    )
    p.add_argument(
        "--vision_tower_dir",
        default=None,
        help="original LLaVA layout: the CLIP vision tower folder (default: mm_vision_tower of config)",
    )
    p.add_argument("--served_model_name", default=None, help="model id in the OpenAI API (default: the folder's name)")
    p.add_argument("--chat_template", default=None, help="a Jinja chat template file overriding the checkpoint's")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tokenizer_workers", type=int, default=2)
    p.add_argument(
        "--graceful_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish while new ones get 503",
    )
    p.add_argument(
        "--request_read_timeout",
        type=float,
        default=60.0,
        help="seconds a request body may take to arrive in full; slower uploads get a 408 (0: no limit)",
    )
    p.add_argument(
        "--stream_write_timeout",
        type=float,
        default=30.0,
        help="seconds a response may wait on a client that does not read; then the connection is dropped and the "
        "request aborted, freeing its KV slots (0: no limit)",
    )
    p.add_argument(
        "--visual_max_restarts",
        type=int,
        default=3,
        help="restarts of a visual process that keeps dying (in a row, with backoff) before the server exits non-zero",
    )
    return p


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ServerConfig(
            model_dir=args.model_dir,
            host=args.host,
            port=args.port,
            tp=args.tp,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            nccl_host=args.nccl_host,
            nccl_port=args.nccl_port,
            visual_dp=args.visual_dp,
            load_format=args.load_format,
            max_total_token_num=args.max_total_token_num,
            mem_fraction=args.mem_fraction,
            running_max_req_size=args.running_max_req_size,
            max_req_total_len=args.max_req_total_len,
            eos_id=tuple(args.eos_id) if args.eos_id else None,
            chunked_prefill_size=args.chunked_prefill_size,
            chunked_prefill=not args.disable_chunked_prefill,
            prefix_cache=not args.disable_dynamic_prompt_cache,
            graph_max_batch_size=args.graph_max_batch_size,
            cuda_graph=not args.disable_cudagraph,
            piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
            trust_remote_code=args.trust_remote_code,
            enable_multimodal=args.enable_multimodal,
            cache_capacity=args.cache_capacity,
            data_type=DTYPE_NAMES[args.data_type],
            device=args.device,
            allow_private_urls=args.allow_private_urls,
            image_dir=args.image_dir,
            tower_turn_ms=args.tower_turn_ms,
            visual_infer_batch_size=args.visual_infer_batch_size,
            visual_batch_max_patches=args.visual_batch_max_patches,
            visual_batch_wait_ms=args.visual_batch_wait_ms,
            vit_att_backend=args.vit_att_backend[0],
            max_image_pixels=args.max_image_pixels,
            max_images_per_request=args.max_images_per_request,
            vision_tower_dir=args.vision_tower_dir,
            served_model_name=args.served_model_name,
            chat_template=args.chat_template,
            log_level=args.log_level,
            tokenizer_workers=args.tokenizer_workers,
            graceful_timeout=args.graceful_timeout,
            request_read_timeout=args.request_read_timeout,
            stream_write_timeout=args.stream_write_timeout,
            visual_max_restarts=args.visual_max_restarts,
        )
    except ValueError as e:
        parser.error(str(e))
