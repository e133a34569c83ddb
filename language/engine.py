"""The engine core: a plain class whose step() schedules, runs the model and updates requests. Process wrappers
only add sockets around it; tests drive it in-process."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from language.config import EngineConfig, LMConfig, resolve_device, resolve_dtype
from language.kv_cache import KVCache
from language.loader import architecture, iter_weights, read_config
from language.model_runner import ModelRunner
from language.models import model_class
from language.request import Request, RequestOutput, RequestStatus
from language.sampler import SamplingBatch, sample
from language.scheduler import Scheduler
from language.warmup import warmup

logger = logging.getLogger(__name__)

_ACTIVATION_RESERVE = 2 << 30  # bytes of GPU memory kept free for activations, logits and CUDA graphs
_CPU_DEFAULT_TOKENS = 16384


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    max_total_token_num: int
    max_req_total_len: int


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_used: int
    kv_total: int


@dataclass
class StepCounters:
    """Cumulative work of the engine, for throughput logs."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0  # wall time inside step() that ran a batch

    def summary(self, since: StepCounters, elapsed_s: float) -> str:
        steps = self.steps - since.steps
        busy = self.busy_s - since.busy_s
        return (
            f"{steps} steps ({busy / max(steps, 1) * 1e3:.1f} ms each), "
            f"prefill {(self.prefill_tokens - since.prefill_tokens) / elapsed_s:.0f} tok/s, "
            f"decode {(self.decode_tokens - since.decode_tokens) / elapsed_s:.0f} tok/s, busy {busy / elapsed_s:.0%}"
        )


def load_model(cfg: EngineConfig, device: torch.device) -> tuple[torch.nn.Module, LMConfig]:
    raw = read_config(cfg.model_dir)
    cls = model_class(architecture(raw))
    lm_cfg: LMConfig = cls.lm_config(cfg.model_dir, raw)
    dtype = resolve_dtype(cfg.dtype, lm_cfg.torch_dtype, device)
    with torch.device(device):
        model = cls(lm_cfg).to(dtype)
    model.raw_config = raw  # families that derive per-request inputs (M-RoPE) read their config keys from it
    model.inv_freq = model.inv_freq.float()  # rotary frequencies stay fp32 whatever the weights' dtype
    model.load_weights(iter_weights(cfg.model_dir))
    return model.eval(), lm_cfg


def kv_capacity(cfg: EngineConfig, lm: LMConfig, dtype: torch.dtype, device: torch.device) -> int:
    if cfg.max_total_token_num is not None:
        return cfg.max_total_token_num
    per_token = KVCache.bytes_per_token(lm.num_layers, lm.num_kv_heads, lm.head_dim, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(free, total * cfg.mem_fraction - (total - free)) - _ACTIVATION_RESERVE
        tokens = int(budget // per_token)
        if tokens <= 0:
            raise RuntimeError("no GPU memory left for the KV cache; lower the model size or raise --mem_fraction")
        return tokens
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(1, min(_CPU_DEFAULT_TOKENS, int(avail * 0.25 // per_token)))


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.model, lm = load_model(cfg, device)
        dtype = next(self.model.parameters()).dtype
        num_slots = kv_capacity(cfg, lm, dtype, device)
        max_req_len = min(cfg.max_req_total_len or lm.max_position, lm.max_position)
        max_reqs = cfg.running_max_req_size
        self.kv = KVCache(lm.num_layers, num_slots, lm.num_kv_heads, lm.head_dim, max_reqs, max_req_len, dtype, device)
        self.scheduler = Scheduler(num_slots, max_reqs, max(cfg.max_prefill_tokens, max_req_len))
        self.runner = ModelRunner(self.model, self.kv, device, cfg.cuda_graph, cfg.cuda_graph_max_batch)
        self.model_info = ModelInfo(
            architecture=lm.architecture,
            eos_token_ids=tuple(cfg.eos_id) if cfg.eos_id is not None else lm.eos_token_ids,
            vocab_size=lm.vocab_size,
            hidden_size=lm.hidden_size,
            dtype=dtype,
            device=device,
            max_total_token_num=num_slots,
            max_req_total_len=max_req_len,
        )
        if device.type == "cuda":
            warmup(self.runner, self.model, lm.hidden_size)
        self.counters = StepCounters()
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        logger.info("engine ready: %s on %s (%s), %d KV slots", lm.architecture, device, dtype, num_slots)

    # ---- requests in ----
    def add_request(self, req: Request) -> None:
        info = self.model_info
        if req.rid in self._requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        if req.max_total_len > info.max_req_total_len:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_new_tokens ({req.params.max_new_tokens}) exceeds the "
                f"maximum request length {info.max_req_total_len}"
            )
        if not self.scheduler.can_ever_fit(req):
            raise ValueError(f"request needs more KV slots than the cache holds ({info.max_total_token_num})")
        if any(t < 0 or t >= info.vocab_size for t in req.prompt_ids):
            raise ValueError("prompt token id out of the vocabulary")
        self.model.prepare_request(req)
        self._requests[req.rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        self._finish(req, "abort")
        self._aborted.append(self._output(req, []))

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule(lambda admitted: self.kv.num_free_rows() > admitted)
        batch = sched.decode + sched.prefill
        if not batch:
            return outputs
        t0 = time.perf_counter()
        logits = []
        if sched.decode:
            logits.append(self.runner.decode(sched.decode))
        if sched.prefill:
            logits.append(self.runner.prefill(sched.prefill))
        sb = SamplingBatch.build(batch, self.model_info.vocab_size, self.model_info.device)
        next_ids, logprobs = sample(torch.cat(logits) if len(logits) > 1 else logits[0], sb)
        for req, token, logprob in zip(batch, next_ids.tolist(), logprobs.tolist(), strict=True):
            outputs.append(self._append_token(req, token, logprob))
        c = self.counters
        c.steps += 1
        c.prefill_tokens += sum(r.prompt_len for r in sched.prefill)
        c.decode_tokens += len(sched.decode)
        c.busy_s += time.perf_counter() - t0
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_used=self.kv.slots.num_used,
            kv_total=self.kv.num_slots,
        )

    # ---- bookkeeping ----
    def _append_token(self, req: Request, token: int, logprob: float) -> RequestOutput:
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        p = req.params
        reason = None
        if (not p.ignore_eos and token in self.model_info.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.model_info.max_req_total_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, [token], [logprob])

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self.kv.free_row(req.req_idx, req.seq_len - 1)  # the last sampled token was never stored
            req.req_idx = -1
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.rid]

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs: list[float] | None = None) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            new_token_ids=tokens,
            new_logprobs=logprobs or [],
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            output_tokens=len(req.output_ids),
        )
