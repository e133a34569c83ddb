"""The visual process's command-line options, one field each (as language/options.py's): name, type, default, help
and --help group in one place. No torch here: the server's command line reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

from visual.attention_backend import VIT_ATT_BACKENDS

_VISION = "vision"  # their --help group


@dataclass(frozen=True)
class VisualOptions:
    visual_infer_batch_size: int = field(
        default=16, metadata={"group": _VISION, "help": "most images in one vision-tower batch"}
    )
    # A burst of large images goes through in small batches, each image's embeddings reaching the LM when its own
    # batch ends, not a 16-image batch's.
    visual_batch_max_patches: int = field(
        default=16384,
        metadata={
            "group": _VISION,
            "help": "most patches (vision-tower positions) in one vision-tower batch, so large images go through in "
            "small batches and reach the LM sooner; a larger image runs alone (0: no limit)",
        },
    )
    # visual/encoder.py, _wait_for_stragglers
    visual_batch_wait_ms: float = field(
        default=10.0,
        metadata={
            "group": _VISION,
            "help": "how long a vision-tower batch that is not full waits for images still being preprocessed, so "
            "that a burst's first images go through in one batch, not one by one (0: never)",
        },
    )
    # visual/tower_turn.py: under a burst of images, a tower left to run ahead shares the GPU with the prefill of the
    # requests at the front; held, it stays a few prompts ahead of the LM instead. 8192 (two prefill chunks): of
    # 0/2048/8192, the one that lowers TTFT p50 at 64 mixed sizes without raising TPOT p50 at 64 x 896 px
    # (docs/performance.md, "One GPU, two processes")
    tower_lookahead_tokens: int = field(
        default=8192,
        metadata={
            "group": _VISION,
            "help": "hold the next vision-tower batch while this many prompt tokens (embeddings ready) wait for "
            "prefill, so the GPU goes to the requests at the front (0: never hold)",
        },
    )
    # visual/tower_graphs.py: small batches are launch-bound (one 336 px image: ~400 launches, ~25 ms of host time
    # for ~2 ms of GPU work); 4096 is one 896 px Qwen2-VL image or seven at 336 px.
    visual_cuda_graph_max_patches: int = field(
        default=4096,
        metadata={
            "group": _VISION,
            "help": "a vision-tower batch of at most this many patches whose image grids were seen before replays a "
            "CUDA graph captured for them (Qwen2-VL, Qwen2.5-VL, Qwen3-VL towers on CUDA; 0: always eager)",
        },
    )
    vit_att_backend: str = field(
        default="auto",
        metadata={
            "group": _VISION,
            "help": "vision-tower attention (LightLLM's flag): auto and triton: ours (visual/kernels/"
            "varlen_attention.py) where it applies, torch's flash elsewhere; sdpa: torch's flash/SDPA only; fa3 and "
            "xformers (not bundled) mean auto. One value per visual data-parallel tower: only one tower here",
            "choices": VIT_ATT_BACKENDS,
            "nargs": "+",
        },
    )
    # visual/models/fp8_linear.py
    vit_quant_type: str = field(
        default="none",
        metadata={
            "group": _VISION,
            "help": "fp8w8a8: the vision tower's encoder-layer linears in FP8 e4m3 (weights per output channel, "
            "activations per token); patch embedding, norms and merger stay in --data_type",
            "choices": ["none", "fp8w8a8"],
        },
    )
    vision_tower_dir: str | None = field(
        default=None,
        metadata={
            "group": _VISION,
            "help": "original LLaVA layout: the CLIP vision tower folder; omitted: mm_vision_tower of config.json",
        },
    )

    def __post_init__(self) -> None:
        if self.visual_infer_batch_size < 1:
            raise ValueError("--visual_infer_batch_size must be >= 1")
        if self.visual_batch_wait_ms < 0:
            raise ValueError("--visual_batch_wait_ms must be >= 0")
        if self.visual_batch_max_patches < 0:
            raise ValueError("--visual_batch_max_patches must be >= 0")
        if self.tower_lookahead_tokens < 0:
            raise ValueError("--tower_lookahead_tokens must be >= 0")
        if self.visual_cuda_graph_max_patches < 0:
            raise ValueError("--visual_cuda_graph_max_patches must be >= 0")
        if self.vit_quant_type not in ("none", "fp8w8a8"):
            raise ValueError("--vit_quant_type must be none or fp8w8a8")
        if self.vit_att_backend not in VIT_ATT_BACKENDS:
            raise ValueError(f"--vit_att_backend must be one of {', '.join(VIT_ATT_BACKENDS)}")
