"""Configuration handed to the engine, built once and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from language.options import DTYPE_NAMES, EngineOptions


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """Configuration handed to the engine: its options and where it runs."""

    model_dir: str
    seed: int = 0
    # Tensor parallelism: where the ranks meet (torch.distributed's init_method, LightLLM's
    # tcp://nccl_host:nccl_port); rank 0 is the engine's own process.
    dist_init_method: str = "tcp://127.0.0.1:28765"
    ranks_per_node: int = 1  # ranks on each host: rank r runs on GPU r % ranks_per_node of its host


@dataclass(frozen=True)
class LMConfig:
    """The decoder's shape, normalised from whichever config dialect the checkpoint uses."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: torch.dtype
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    mrope_section: tuple[int, ...] | None = None  # Qwen2-VL M-RoPE bands over the half head dim
    mrope_interleaved: bool = False  # Qwen3-VL: the bands cycle t, h, w instead of lying in three blocks
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before the rotary embedding


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of a process; `local_rank`: its tensor-parallel rank on this host (its GPU's index)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and local_rank:
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, DTYPE_NAMES[name])
    if device.type == "cpu" and checkpoint_dtype == torch.float16:
        return torch.float32  # half-precision matmuls on CPU are slow and not what a CPU user wants
    return checkpoint_dtype
