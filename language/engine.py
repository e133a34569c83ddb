"""The engine core: a plain class whose step() schedules, runs the model and updates requests. Process wrappers
only add sockets around it; tests drive it in-process."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from language.config import EngineConfig, resolve_device
from language.engine_stats import EngineStats, StepCounters
from language.grammar import Grammars, VocabularyBuilder
from language.kernels.launch_utils import set_pdl
from language.model_builder import build_kv_cache, load_model, model_config
from language.model_info import ModelInfo
from language.model_runner import InflightStep, ModelRunner
from language.parallel.group import TPGroup, init_tp
from language.parallel.step_sync import StepChannel
from language.prefix_cache import PrefixCache, cache_ids
from language.request import (
    PrefixNotCached,
    PromptLogprobs,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
    TopLogprobs,
)
from language.request_checks import check_request, refuse
from language.scheduler import Scheduler
from language.step_inputs import StagedStep, stage
from language.structured import StructuredDecoding
from language.warmup import warmup

logger = logging.getLogger(__name__)

Collected = tuple[Request, int, float, TopLogprobs | None]  # a sample read back: request, token, logprob, top


class EngineCore:
    """Schedules, launches and collects steps. The loop is overlapped: `step()` stages step N+1 on the host while
    step N runs on the device, launches N+1, then reads N's samples back (the only wait, behind N+1 on the device)
    and returns N's outputs. N+1's decode rows take their input ids on the device from N's samples (`last_token`,
    indexed by table row), so nothing of N is needed on the host to launch N+1. A request that N finishes (EOS, a
    stop token) runs once more in N+1: finishing frees its row and slots, which only steps after N+1 reuse, and its
    sample there is ignored (as an aborted request's). max_new_tokens never wastes a row: staging counts samples.

    Penalties read a request's earlier tokens from counts kept on the device (language/penalties.py), which each
    sample adds to in stream order, so they need nothing of N on the host either. The exception: under the router
    (`step(emit)`), an eager step with prompt rows reads the previous step back and hands its tokens over before it
    is launched (its launch takes tens of ms of host).

    A request's image embeddings are dropped once the step that ran its prompt's last chunk has been collected
    (the device has read every image row by then, on any chunking); its first output token says so to the owner
    of the embedding cache, which releases the entries then, not when the request finishes.

    Structured output (language/structured.py): a step holding rows constrained by a grammar launches its forward
    first, then reads the previous step back (its tokens advance the grammars), fills the token masks on the host
    while the device runs the forward, and only then launches the sampling; other steps run as above.

    vocabulary: builds xgrammar's view of the model's tokenizer (the caller owns the tokenizer); None: structured
    requests are refused."""

    def __init__(self, cfg: EngineConfig, vocabulary: VocabularyBuilder | None = None):
        self.cfg = cfg
        device = resolve_device(cfg.device)
        set_pdl(cfg.pdl)  # before any kernel runs: the decode graphs capture the launches as they are made
        torch.manual_seed(cfg.seed)
        # Tensor parallelism: this process is rank 0; the other ranks follow its steps (language/parallel/worker.py).
        model_config(cfg)
        self.tp = init_tp(0, cfg.tp, cfg.dist_init_method, device) if cfg.tp > 1 else TPGroup()
        self.model, lm = load_model(cfg, device, self.tp)
        self.kv = build_kv_cache(cfg, self.model, lm, device, self.tp)
        dtype, num_slots, max_req_len = self.kv.dtype, self.kv.num_slots, self.kv.max_req_len
        max_reqs = cfg.running_max_req_size
        if cfg.chunked_prefill:
            budget = cfg.chunked_prefill_size
        else:  # whole prompts: the budget only limits how many join one step
            budget = max(cfg.chunked_prefill_size, max_req_len)
        self.prefix = PrefixCache(self.kv.slots) if cfg.prefix_cache else None
        self.scheduler = Scheduler(num_slots, max_reqs, budget, cfg.chunked_prefill, self.prefix,
                                   whole_images=self.model.bidirectional_images)  # fmt: skip
        channel = StepChannel(self.tp) if self.tp.enabled else None
        self.runner = ModelRunner(
            self.model, self.kv, device, cfg.cuda_graph, cfg.graph_max_batch_size, channel,
            piecewise_cuda_graph_max_tokens=cfg.piecewise_cuda_graph_max_tokens,
        )  # fmt: skip
        self.model_info = ModelInfo(
            architecture=lm.architecture,
            eos_token_ids=tuple(cfg.eos_id) if cfg.eos_id is not None else lm.eos_token_ids,
            vocab_size=lm.vocab_size,
            hidden_size=lm.hidden_size,
            mm_embed_width=self.model.mm_embed_width,
            dtype=dtype,
            device=device,
            max_total_token_num=num_slots,
            max_req_total_len=max_req_len,
        )
        self.runner.eos_token_ids = self.model_info.eos_token_ids  # sampling masks and boosts read them
        self.structured = None
        if vocabulary is not None and cfg.output_constraint_mode == "xgrammar":
            grammars = Grammars(vocabulary, self.runner.vocab_size, self.model_info.eos_token_ids)
            self.structured = StructuredDecoding(grammars, device)
        self.counters = StepCounters()
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._inflight: InflightStep | None = None
        self._failed_last_step = False  # the last step that ran anything raised
        if device.type == "cuda":
            warmup(self)
        logger.info("engine ready: %s on %s (%s), %d KV slots (%s, %d bytes each)%s", lm.architecture, device, dtype,
                    num_slots, str(self.kv.storage_dtype).removeprefix("torch."), self.kv.slot_bytes,
                    f", tensor parallel over {cfg.tp} ranks" if self.tp.enabled else "")  # fmt: skip

    def close(self) -> None:
        """Let the other tensor-parallel ranks stop (they wait for rank 0's next step otherwise)."""
        if self.structured is not None:
            self.structured.grammars.close()
        if self.runner.channel is not None:
            self._read_back()
            self.runner.channel.stop()
            self.runner.channel = None

    # ---- requests in ----
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise RequestRejected (a ValueError) saying why it can never run; PrefixNotCached
        for images sent without embeddings whose KV is not cached."""
        self._check(req)
        self.model.prepare_request(req)
        p = req.params
        if p.prompt_logprobs is not None:
            # Every prompt position must run to be scored: a cached prefix has no logits, so such a request neither
            # reuses the prefix cache nor adds to it (as vLLM skips the cache for prompt logprobs).
            req.prompt_logprobs = PromptLogprobs(list(req.prompt_ids), top=[] if p.prompt_logprobs else None)
        elif self.prefix is not None and not p.disable_prompt_cache:
            req.cache_ids = cache_ids(req)
        if any(item.embeds is None for item in req.mm_items) and not self.scheduler.reserve_prefix(req):
            raise PrefixNotCached(f"request {req.rid}: an image sent without embeddings is not in the prefix cache")
        self._requests[req.rid] = req
        if p.structured is not None:  # scheduled once its grammar has compiled
            self.structured.submit(req)
        else:
            self.scheduler.add(req)

    def _check(self, req: Request) -> None:
        if req.rid in self._requests:
            refuse("inputs", f"request id {req.rid!r} is already in use")
        no_structured = _NO_STRUCTURED[self.cfg.output_constraint_mode] if self.structured is None else None
        check_request(req, self.model_info, no_structured)

    def abort(self, rid: str) -> None:
        """Finish a request now. If a step in flight still writes its cache, its slots are reused only by later
        steps, which the device runs after that one; its sample is ignored when the step is read back."""
        req = self._requests.get(rid)
        if req is None:
            return
        self._finish(req, "abort")
        self._aborted.append(self._output(req, []))

    # ---- one step ----
    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Launch the next step and return what the previous one produced (and any aborts).

        emit: if given, it takes those outputs before an eager step with prompt tokens is launched (and step returns
        the rest, if any): launching an eager forward over thousands of prompt tokens keeps the host busy for tens of
        ms, and the previous step's tokens need not wait for that. Steps that replay graphs are launched first.

        A step that raises (one request's inputs the admission checks let through, say) fails every request the
        engine holds, returns all KV slots and goes on with the next request: the state a half-staged step leaves
        cannot be trusted, and a fresh one can. Under tensor parallelism the other ranks would be left mid-step,
        and a second failure in a row means the engine itself is broken (a device error): both still raise."""
        held, aborted = list(self._requests.values()), self._aborted
        delivered: set[str] = set()  # final outputs emit already sent

        def emit_noting(outputs: list[RequestOutput]) -> None:
            delivered.update(out.rid for out in outputs if out.finished)
            emit(outputs)

        try:
            outputs = self._step(emit_noting if emit is not None else None)
        except Exception as e:
            if self.tp.enabled or self._failed_last_step:
                raise
            logger.exception("an engine step failed: failing the %d requests the engine holds", len(held))
            self._failed_last_step = True
            reason = RequestError.server_failure(f"the step that ran this request raised {type(e).__name__}: {e}")
            return self._fail_all(held, aborted, delivered, reason)
        if self._inflight is not None:
            self._failed_last_step = False
        return outputs

    def _fail_all(
        self, held: list[Request], aborted: list[RequestOutput], delivered: set[str], reason: RequestError
    ) -> list[RequestOutput]:
        """The final output of every request held when the failed step began (aborts stand, the rest end in an
        error), then a clean slate: all KV slots and rows free, an empty prefix cache and queue."""
        self._inflight, self._aborted = None, []  # later steps run after the failed one's device work, if any
        outputs = [out for out in aborted if out.rid not in delivered]
        for req in held:  # one that finished in the failed step lost its last output with it
            req.status, req.finish_reason, req.req_idx, req.kv_slots, req.mm_items = (
                RequestStatus.FINISHED, "error", -1, [], []
            )  # fmt: skip
            if req.rid not in delivered:
                outputs.append(dataclasses.replace(self._output(req, []), error=reason))
        self._requests.clear()
        if self.structured is not None:
            self.structured.clear()
        self.kv.reset()
        if self.prefix is not None:
            self.prefix = PrefixCache(self.kv.slots)
        s = self.scheduler
        self.scheduler = Scheduler(
            s.max_total_token_num, s.running_max_req_size, s.prefill_budget, s.chunked_prefill, self.prefix,
            whole_images=s.whole_images,
        )  # fmt: skip
        return outputs

    def _step(self, emit: Callable[[list[RequestOutput]], None] | None) -> list[RequestOutput]:
        if self.structured is not None and self.structured.pending:
            self._schedule_compiled()
        outputs, self._aborted = self._aborted, []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(lambda admitted: self.kv.num_free_rows() > admitted)
        if plan.admitted:
            admitted_at = time.monotonic()
            for req in plan.admitted:
                req.scheduled_at = admitted_at
        collected: list[Collected] = []
        staged = None
        if plan:
            staged = stage(plan, self.kv, self.model.position_dims, self.prefix, self.model.bidirectional_images)
        if self._constrained(staged):
            collected += self._launch_constrained(staged)
        elif staged is not None and emit is not None and self._eager_prompt_step(staged):
            collected += self._read_back()
            staged.drop_finished()
            emit(outputs + self._outputs_of(collected))
            outputs, collected = [], []
            self._inflight = self.runner.launch(staged)
        else:  # launched before the step in flight is read back: the device goes from one to the other
            previous, self._inflight = self._inflight, None
            if staged is not None:
                self._inflight = self.runner.launch(staged)
            if previous is not None:
                collected += self._collect(previous)
        # Built while the device runs the step just launched.
        outputs += self._outputs_of(collected)
        if plan or outputs:
            self.counters.busy_s += time.perf_counter() - t0
        return outputs

    def _eager_prompt_step(self, staged: StagedStep) -> bool:
        """A step with prompt rows that does not replay graphs: its launch keeps the host busy for tens of ms, so the
        step in flight is read back and its tokens handed over first (the device idles meanwhile, as it would
        through most of that launch anyway)."""
        return bool(staged.prefill.reqs) and not self.runner.replays_pieces(staged.num_tokens)

    def _constrained(self, staged: StagedStep | None) -> bool:
        """The step holds rows under a grammar (one look at a counter while no request has one)."""
        s = self.structured
        if staged is None or s is None or not s.live:
            return False
        return s.constrained(staged.decode.reqs) or s.constrained(staged.prefill.reqs)

    def _launch_constrained(self, staged: StagedStep) -> list[Collected]:
        """A step with grammar-constrained rows: its forward goes to the device before the step in flight is read
        back, and its sampling once that step's tokens have advanced the grammars and the masks are filled, so the
        host's grammar work overlaps the forward. Rows whose request the collected step finished still run (as an
        aborted request's do); their samples are ignored and they get no mask. A request whose grammar grew too slow
        to fill its mask ends here with a 400 (structured.FILL_BUDGET_S). Returns the collected samples."""
        forwarded = self.runner.forward(staged)
        collected = self._read_back()
        mask, too_slow = self.structured.token_mask(forwarded.sampled)
        self._inflight = self.runner.sample(forwarded, mask)
        self._inflight.constrained = True
        for req, message in too_slow:  # its row's sample will be ignored, as an aborted request's
            self._fail_constraint(req, message)
        ended = {req.rid for req, _ in too_slow}  # their error is their last output
        return [c for c in collected if c[0].rid not in ended]

    def _schedule_compiled(self) -> None:
        """Waiting requests whose grammar has compiled go to the scheduler; those whose grammar does not compile
        end here with a 400."""
        idle = self._inflight is None and not self.scheduler.running and not self.scheduler.waiting
        compiled, failed = self.structured.ready(idle)
        for req in compiled:
            self.scheduler.add(req)
        for req, message in failed:
            self._fail_constraint(req, message)

    def _fail_constraint(self, req: Request, message: str) -> None:
        """The request's constraint does not compile, or grew too slow to match: it ends with a 400 naming it."""
        self._finish(req, "error")
        error = RequestError.refused("parameters.structured", message)
        self._aborted.append(dataclasses.replace(self._output(req, []), error=error))

    def _outputs_of(self, collected: list[Collected]) -> list[RequestOutput]:
        return [self._output(req, [token], [logprob], top) for req, token, logprob, top in collected]

    def _read_back(self) -> list[Collected]:
        """Collect the step in flight, if any."""
        inflight, self._inflight = self._inflight, None
        return self._collect(inflight) if inflight is not None else []

    def _collect(self, inflight: InflightStep) -> list[Collected]:
        """Wait for a launched step and hand its samples to their requests: (request, token, logprob, its top
        alternatives or None) each; prompt scores go to their requests' prompt_logprobs first. A request that
        finished after the step was launched (an abort, or a stop read back from the step before) gets nothing."""
        out = inflight.wait()
        if logger.isEnabledFor(logging.DEBUG):  # a timeline of the steps (perf_counter: one clock for the host)
            logger.debug("step timing: launched=%.4f collected=%.4f prefill_tokens=%d decode=%d", inflight.launched_at,
                         time.perf_counter(), inflight.num_prefill_tokens, inflight.num_decode)  # fmt: skip
        start = 0
        for req, n in inflight.scored:
            if not req.finished:
                scores = req.prompt_logprobs
                scores.logprobs += out.prompt_logprobs[start : start + n]
                if scores.top is not None:
                    scores.top += out.prompt_top(start, n, req.params.prompt_logprobs)
            start += n
        collected = []
        for req, row in inflight.sampled:
            if req.mm_items:  # its prompt's last chunk ran in this step: nothing reads its image rows any more
                req.mm_items = []  # unmaps the shared memory (the owner releases its cache entries on this output)
            if not req.finished:
                token, logprob = out.ids[row], out.logprobs[row]
                self._append_token(req, token, logprob)
                collected.append((req, token, logprob, out.top(row, req.params.top_logprobs)))
        if inflight.constrained:
            for req in self.structured.advance([(req, token) for req, token, _, _ in collected]):
                if not req.finished:
                    self._finish(req, "stop")
        c = self.counters
        c.steps += 1
        c.prefill_tokens += inflight.num_prefill_tokens
        c.decode_tokens += inflight.num_decode
        return collected

    def prompt_tokens_in_flight(self) -> int:
        """Prompt tokens the step still on the device prefills (0 when none is in flight or it has finished)."""
        inflight = self._inflight
        if inflight is None or inflight.done():
            return 0
        return inflight.num_prefill_tokens

    def has_prompt_work(self) -> bool:
        """Prompt tokens wait to be prefilled: a request not yet admitted, or one part way through its prompt."""
        return self.scheduler.has_prompt_work()

    def prompt_backlog_fills_step(self) -> bool:
        """Prompts already queued fill the next step's prefill budget (see Scheduler.prompt_backlog_fills_step)."""
        return self.scheduler.prompt_backlog_fills_step()

    def prompt_backlog(self, cap: int) -> int:
        """Prompt tokens still to prefill, counted up to cap (see Scheduler.prompt_backlog)."""
        return self.scheduler.prompt_backlog(cap)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted) or self._inflight is not None

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + (len(self.structured.pending) if self.structured else 0),
            kv_used=self.kv.slots.num_used - (self.prefix.evictable_tokens if self.prefix else 0),
            kv_total=self.kv.num_slots,
            prefix_cache_tokens=self.prefix.total_tokens if self.prefix else 0,
            prefix_cache_hit_tokens=self.prefix.hit_tokens if self.prefix else 0,
            peak_tokens=self.scheduler.peak_tokens,
        )

    # ---- bookkeeping ----
    def _append_token(self, req: Request, token: int, logprob: float) -> None:
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        p = req.params
        reason = None
        if (not p.ignore_eos and token in self.model_info.eos_token_ids) or token in p.stop_id_set:
            reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.model_info.max_req_total_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.grammar is not None:
            self.structured.release(req)
        self.runner.penalties.release(req)
        if req.status is RequestStatus.RUNNING:
            if req.prefix_node is not None:
                # Its answer stays too, so a follow-up turn reuses it. The last sampled token is never stored: a
                # step launched after its last sample writes it to a slot freed here, which later steps reuse.
                written = min(req.kv_len, req.prompt_len + len(req.output_ids) - 1)
                self.prefix.release(req, req.cache_ids + req.output_ids, written)
                self.kv.free_row(req.req_idx, [])
            else:
                self.kv.free_row(req.req_idx, req.kv_slots)
            req.req_idx, req.kv_slots = -1, []
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.rid]

    @staticmethod
    def _output(
        req: Request, tokens: list[int], logprobs: list[float] | None = None, top: TopLogprobs | None = None
    ) -> RequestOutput:
        first = bool(tokens) and len(req.output_ids) == 1  # the prompt's scores ride with the first token
        return RequestOutput(
            rid=req.rid,
            new_token_ids=tokens,
            new_logprobs=logprobs or [],
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            output_tokens=len(req.output_ids),
            cached_tokens=req.prompt_cache_len,
            new_top_logprobs=None if top is None else [top],
            prompt_logprobs=req.prompt_logprobs if first else None,
            scheduled_at=req.scheduled_at,
        )


_NO_STRUCTURED = {
    "none": "structured output is off on this server (--output_constraint_mode none)",
    "xgrammar": "this engine was built without a tokenizer for structured output",
}
