"""Configuration handed to the engine, built once and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    max_total_token_num: int | None = None  # KV slots; None: size from free memory and mem_fraction
    mem_fraction: float = 0.9
    running_max_req_size: int = 1000
    max_req_total_len: int | None = None  # prompt + new tokens of one request; None: the model's context length
    # Prompt tokens prefilled per step (LightLLM's --chunked_prefill_size): longer prompts are split across steps,
    # so running requests keep decoding while they prefill, and activation memory stays bounded.
    chunked_prefill_size: int = 4096
    chunked_prefill: bool = True  # False: whole prompts (a long one still runs alone in its step)
    # Keep the KV of earlier prompts and answers in a radix tree and reuse it for requests that share a prefix
    # (LightLLM's --disable_dynamic_prompt_cache turns it off).
    prefix_cache: bool = True
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eos_id: tuple[int, ...] | None = None  # overrides the checkpoint's EOS ids
    trust_remote_code: bool = False
    cuda_graph: bool = True  # capture decode steps on GPU
    cuda_graph_max_batch: int = 256  # LightLLM's --graph_max_batch_size
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if self.cuda_graph_max_batch < 1:
            raise ValueError("graph_max_batch_size must be >= 1")


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(name, name))
    if device.type == "cpu" and checkpoint_dtype == torch.float16:
        return torch.float32  # half-precision matmuls on CPU are slow and not what a CPU user wants
    return checkpoint_dtype
