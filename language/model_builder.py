"""Building the decoder and its KV cache from an engine config: what rank 0's engine and every other tensor-parallel
rank's worker do alike before their first step."""

from __future__ import annotations

import logging
import os
import time

import torch

from families import family
from language.config import EngineConfig, LMConfig, resolve_dtype
from language.kv_cache import KVCache
from language.loader import architecture, count_weights, iter_weights, read_config
from language.parallel.group import TPGroup
from language.parallel.sharding import check_divisible
from language.progress import progress
from language.quant.head import quantize_lm_head
from language.quant.linear import swap_linears
from language.quant.scheme import quant_scheme

logger = logging.getLogger(__name__)

_ACTIVATION_RESERVE = 2 << 30  # bytes of GPU memory kept free for activations, logits and CUDA graphs
_CPU_DEFAULT_TOKENS = 16384


def model_config(cfg: EngineConfig) -> tuple[type, dict, LMConfig]:
    """The decoder class, config.json and the decoder's shape; a tp that cannot split it raises ValueError (each
    rank checks before it joins the group, so the message comes before any rank waits for another)."""
    raw = read_config(cfg.model_dir)
    spec = family(architecture(raw))
    cls = spec.part("decoder")
    lm_cfg: LMConfig = spec.part("config_reader")(cfg.model_dir, raw)
    check_divisible(lm_cfg, cfg.tp)
    return cls, raw, lm_cfg


def load_model(cfg: EngineConfig, device: torch.device, tp: TPGroup | None = None) -> tuple[torch.nn.Module, LMConfig]:
    """The decoder (this rank's shard of it under tensor parallelism) with its weights, on `device`."""
    cls, raw, lm_cfg = model_config(cfg)
    dtype = resolve_dtype(cfg.data_type, lm_cfg.torch_dtype, device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its final dtype on the device: no fp32 copy of 7B weights to cast
    t0 = time.perf_counter()
    try:
        with torch.device(device):
            model = cls(lm_cfg, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    logger.info("model built on %s in %.1f s", device, time.perf_counter() - t0)
    model.raw_config = raw  # families that derive per-request inputs (M-RoPE) read their config keys from it
    model.inv_freq = model.inv_freq.float()  # rotary frequencies stay fp32 whatever the weights' dtype
    model.quant = scheme = quant_scheme(cfg.quant_type, raw)
    # An FP8 checkpoint's tensors load into FP8 layers; bf16 weights (and dummy ones) are quantized once loaded.
    load_fp8 = scheme is not None and scheme.prequantized and cfg.load_format != "dummy"
    if load_fp8:
        swap_linears(model, scheme, quantize=False, fused_quant=cfg.fp8_fused_quant)
    if cfg.load_format == "dummy":
        # vLLM's --load_format dummy: the random init the layers were built with (on the device), no files read.
        logger.warning("--load_format dummy: serving RANDOM weights (for benchmarks; the text is gibberish)")
    else:
        wanted = lambda name: model.checkpoint_name(name) is not None  # noqa: E731
        weights = iter_weights(cfg.model_dir, keep=wanted, device=device, take=model.shard_tensor)
        model.load_weights(progress(weights, count_weights(cfg.model_dir, wanted), "loading weights", logger))
    if scheme is not None and not load_fp8:
        swap_linears(model, scheme, quantize=True, fused_quant=cfg.fp8_fused_quant)
    if scheme is not None:
        logger.info("decoder linear layers: %s", scheme.describe())
    if scheme is not None and not scheme.prequantized and cfg.quant_lm_head:  # a published one's head stays as is
        quantize_lm_head(model)
        logger.info("LM head: FP8 e4m3 per vocabulary row, quantized at load")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # tensors in transit were cached blocks: give them back before sizing the KV cache
    return model.eval(), lm_cfg


def kv_capacity(cfg: EngineConfig, lm: LMConfig, kv_heads: int, dtype: torch.dtype, device: torch.device) -> int:
    """KV slots that fit this process's memory (`kv_heads`: the heads this rank caches)."""
    if cfg.max_total_token_num is not None:
        return cfg.max_total_token_num
    per_token = KVCache.bytes_per_token(lm.num_layers, kv_heads, lm.head_dim, dtype, cfg.llm_kv_type)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(free, total * cfg.mem_fraction - (total - free)) - _ACTIVATION_RESERVE
        tokens = int(budget // per_token)
        if tokens <= 0:
            raise RuntimeError("no GPU memory left for the KV cache; lower the model size or raise --mem_fraction")
        return tokens
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(1, min(_CPU_DEFAULT_TOKENS, int(avail * 0.25 // per_token)))


def build_kv_cache(
    cfg: EngineConfig, model: torch.nn.Module, lm: LMConfig, device: torch.device, tp: TPGroup
) -> KVCache:
    """This rank's KV cache (its KV heads). Every rank gets the slot count the tightest rank's memory allows, so
    that rank 0's slot allocation fits all of them."""
    dtype = next(model.parameters()).dtype
    kv_heads = model.shard.kv_heads
    num_slots = tp.min_over_ranks(kv_capacity(cfg, lm, kv_heads, dtype, device))
    max_req_len = min(cfg.max_req_total_len or lm.max_position, lm.max_position)
    max_reqs = cfg.running_max_req_size
    return KVCache(
        lm.num_layers, num_slots, kv_heads, lm.head_dim, max_reqs, max_req_len, dtype, device, cfg.llm_kv_type
    )
