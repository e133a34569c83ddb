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
    # Prompt and mixed steps of up to this many tokens replay piecewise graphs (attention eager); 0: all eager.
    piecewise_graph_max_tokens: int = 1024
    seed: int = 0
    # Tensor parallelism: ranks over which the decoder is split, and where they meet (torch.distributed's
    # init_method, LightLLM's tcp://nccl_host:nccl_port); rank 0 is the engine's own process.
    tp: int = 1
    dist_init_method: str = "tcp://127.0.0.1:28765"
    ranks_per_node: int = 1  # ranks on each host: rank r runs on GPU r % ranks_per_node of its host
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights from config.json alone

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError("tp must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if self.cuda_graph_max_batch < 1:
            raise ValueError("graph_max_batch_size must be >= 1")
        if self.piecewise_graph_max_tokens < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 0")


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
        return getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(name, name))
    if device.type == "cpu" and checkpoint_dtype == torch.float16:
        return torch.float32  # half-precision matmuls on CPU are slow and not what a CPU user wants
    return checkpoint_dtype
