"""The HTTP process's side of the pipeline: sends tokenized requests to the router, routes text pieces from the
detokenizer to each request's stream, keeps the metrics, and watches the child processes."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import zmq
import zmq.asyncio

from language.sampling_params import SamplingParams
from mmserve.http.metrics import ServerMetrics
from mmserve.http.protocol import BadRequest, GenerateInput, ServerFailure
from mmserve.ipc.endpoints import Endpoints
from mmserve.ipc.messages import AbortRequest, DetokBatch, ImagesReady, TextOutput
from mmserve.ipc.zmq_queue import AsyncPullQueue, AsyncPushQueue
from mmserve.launch.processes import ChildProcess
from mmserve.prep.tokenization import RequestPreparer

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.2


class Service(Protocol):
    """Something that lives on the HTTP event loop beside the client (e.g. the link to the visual process, its
    supervisor)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def degraded(self) -> str | None:
        """Why the server serves only in part now (/health says "degraded"), or None."""


class ClientDisconnected(Exception):
    pass


class RequestStream:
    """The text outputs of one request, in order, as they arrive."""

    def __init__(self, rid: str, return_details: bool, arrival: float | None = None, image_tokens: int = 0):
        self.rid = rid
        self.return_details = return_details
        self.queue: asyncio.Queue[TextOutput | ServerFailure] = asyncio.Queue()
        self.arrival = time.monotonic() if arrival is None else arrival  # before tokenization and image encoding
        self.image_tokens = image_tokens  # the prompt's image placeholder tokens (LightLLM's input_usage)
        self.first_token_time: float | None = None
        self.admitted = False  # the engine's admission was seen (the queue time is observed once)
        self.finished = False

    def has_queued(self) -> bool:
        """An output (or a failure) is waiting: next() would return at once."""
        return not self.queue.empty()

    async def next(self, disconnected: asyncio.Future) -> TextOutput:
        """The next output; raises ServerFailure, or ClientDisconnected once `disconnected` is done."""
        if self.queue.empty():
            getter = asyncio.ensure_future(self.queue.get())
            await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                raise ClientDisconnected
            item = getter.result()
        else:
            item = self.queue.get_nowait()
        if isinstance(item, ServerFailure):
            raise item
        self.finished = item.finished
        return item


class EngineClient:
    def __init__(
        self,
        preparer: RequestPreparer,
        children: list[ChildProcess],  # the ones the server cannot run without (router, detokenizer)
        endpoints: Endpoints,
        metrics: ServerMetrics,
        tokenizer_workers: int,
        services: Sequence[Service] = (),
    ):
        self.preparer = preparer
        self.children = children
        self.endpoints = endpoints
        self.metrics = metrics
        self.services = list(services)  # started and stopped with the client, on its event loop
        self.failure: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None  # set by whoever runs the HTTP server
        self._streams: dict[str, RequestStream] = {}
        self._group_of: dict[str, str] = {}  # member rid -> the group's (tokenized) rid, for n / best_of > 1
        self._group_left: dict[str, int] = {}  # group rid -> members not yet ended
        self._released_early: set[str] = set()  # running rids whose images were released when their prefill ran
        self._abandoned: set[str] = set()  # rids whose stream is gone, held until the router's last output for them
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_workers, thread_name_prefix="tokenize")
        self._tasks: list[asyncio.Task] = []
        self._encodes: set[asyncio.Task] = set()  # deferred images being encoded (see _encode_deferred)
        self._ctx: zmq.asyncio.Context | None = None

    # ------------------------------------------------------------------------------------------- life cycle

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._failed = asyncio.Event()
        self._to_router = AsyncPushQueue(self._ctx, self.endpoints.router)
        self._inbox = AsyncPullQueue(self._ctx, self.endpoints.http)
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_children())]
        for service in self.services:
            await service.start()

    async def stop(self) -> None:
        tasks = self._tasks + list(self._encodes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all("the server is shutting down")
        for service in self.services:
            await service.stop()
        self._to_router.close()
        self._inbox.close()
        self._ctx.term()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fail_in_flight(self, reason: str) -> None:
        """End every request still running with a ServerFailure (503, or an error event): the server is stopping."""
        self._fail_all(reason)
        # the router is stopped next, and its KV with it: no aborts to send

    def healthy(self) -> bool:
        return self.failure is None and all(c.alive() for c in self.children)

    def degraded(self) -> str | None:
        return next((reason for s in self.services if (reason := s.degraded()) is not None), None)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------------------------------- requests

    async def submit(self, req: GenerateInput) -> RequestStream:
        """Tokenize off the event loop and hand to the router; raises BadRequest or ServerFailure."""
        (stream,) = await self.submit_group(req, 1)
        return stream

    async def submit_group(self, req: GenerateInput, count: int) -> list[RequestStream]:
        """As submit, fanned out into `count` engine requests (n / best_of) that share one tokenization and the
        images it holds: rids `<rid>-0` ... `<rid>-<count-1>`; request i > 0 with a seed samples with seed + i, so
        the sequences differ yet repeat. What the preparer holds is released when the last of them ends."""
        if self.failure is not None:
            raise ServerFailure(self.failure)
        arrival = time.monotonic()
        rid = uuid.uuid4().hex
        try:
            tokenized = await self._unless_failed(self.preparer.prepare(rid, req, self.run_sync))
        except asyncio.CancelledError:  # the handler was cancelled: prepare may have finished meanwhile
            self.preparer.release(rid)
            raise
        if self.failure is not None:
            self.preparer.release(rid)
            raise ServerFailure(self.failure)
        if count == 1:
            subs = [tokenized]
        else:
            if tokenized.wait_for_images:  # ImagesReady names the tokenized rid: it cannot be shared
                self.preparer.release(rid)
                raise BadRequest("parameters.n", "n / best_of > 1 is not supported for this request")
            subs = [replace(tokenized, rid=f"{rid}-{i}", params=_sub_params(tokenized.params, i)) for i in range(count)]
            self._group_left[rid] = count
            for sub in subs:
                self._group_of[sub.rid] = rid
        streams = []
        image_tokens = sum(image.num_tokens for image in tokenized.images)
        for sub in subs:
            stream = RequestStream(sub.rid, req.params.return_details, arrival, image_tokens)
            self._streams[sub.rid] = stream
            self._to_router.send_nowait(sub)
            streams.append(stream)
        self.metrics.requests.inc()
        self.metrics.max_tokens.observe(tokenized.params.max_new_tokens)
        return streams

    def abort(self, rid: str) -> None:
        """The client is gone: stop generating and free the request's KV slots."""
        if self._streams.pop(rid, None) is not None:
            self._abandon(rid)

    def _abandon(self, rid: str) -> None:
        """Have the router drop a request whose stream is gone. What the preparer holds for it (its images' cache
        entries) stays held until the router's last output for it comes back (`_deliver`): the router may not have
        taken the request from its inbox yet (it reads it between steps, and a step can run for seconds), and it
        reads the images' embeddings from the cache when it does. Released here, they could be evicted first."""
        if self.failure is not None:  # the router is gone: nothing will read them
            self._end(rid)
            return
        self._abandoned.add(rid)
        self._to_router.send_nowait(AbortRequest(rid))

    def _end(self, rid: str) -> None:
        """One engine request ended (each exactly once: whoever pops its stream calls this)."""
        if rid in self._released_early:
            self._released_early.discard(rid)
        else:
            self._release(rid)

    def _prefill_ran(self, rid: str) -> None:
        """The engine has run the request's whole prompt (its first token came): its images' cache entries are
        not read any more, so they are released now rather than when it finishes."""
        if rid not in self._released_early:
            self._released_early.add(rid)
            self._release(rid)

    def _release(self, rid: str) -> None:
        """What the preparer holds for one engine request (its images' cache entries), once per request: when its
        prefill has run or it ended, whichever comes first. A group's go when each of its members is done."""
        group = self._group_of.pop(rid, None)
        if group is None:
            self.preparer.release(rid)
            return
        self._group_left[group] -= 1
        if self._group_left[group] == 0:
            del self._group_left[group]
            self.preparer.release(group)

    @property
    def num_abandoned(self) -> int:
        """Requests whose client left and whose end the router has not reported yet (they still hold their images)."""
        return len(self._abandoned)

    @property
    def num_groups(self) -> int:
        """Fanned-out requests with members still running (0 once everything has ended: nothing leaks)."""
        return len(self._group_left)

    async def _unless_failed(self, coro):
        """Await coro, but raise ServerFailure as soon as a child dies (it may be waiting on that child, e.g. for
        an image encoding). Cancelled, it cancels coro (which then releases what it holds)."""
        task = asyncio.ensure_future(coro)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            raise ServerFailure(self.failure)
        return task.result()

    async def run_sync(self, fn: Callable, *args):
        """fn(*args) in the tokenizer thread pool, awaited (keeps slow work off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------------------------------- background

    async def _receive_loop(self) -> None:
        try:
            while True:
                batch = await self._inbox.recv()
                if not isinstance(batch, DetokBatch):
                    raise TypeError(f"HTTP server got {type(batch).__name__}")
                self._deliver(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken pipeline must not leave requests hanging
            logger.exception("receive loop failed")
            self.fatal(f"receive loop failed: {e!r}")

    def _deliver(self, batch: DetokBatch) -> None:
        if batch.stats is not None:
            self.metrics.on_stats(batch.stats)
        for rid in batch.encode_needed:
            if rid in self._streams:
                task = asyncio.create_task(self._encode_deferred(rid))
                self._encodes.add(task)
                task.add_done_callback(self._encodes.discard)
        now = time.monotonic()
        for out in batch.outputs:
            if out.tokens:
                self.metrics.generated_tokens.inc(len(out.tokens))
            self.metrics.on_output(out)
            stream = self._streams.get(out.rid)
            if stream is None:  # aborted by its client meanwhile
                if out.finished and out.rid in self._abandoned:  # the router has dropped it: nothing reads its images
                    self._abandoned.discard(out.rid)
                    self._end(out.rid)
                continue
            if not stream.admitted and out.scheduled_at is not None:
                stream.admitted = True
                self.metrics.queue_time.observe(max(out.scheduled_at - stream.arrival, 0.0))
            if stream.first_token_time is None and out.tokens:
                stream.first_token_time = now
                self.metrics.ttft.observe(now - stream.arrival)
            if out.output_tokens and not out.finished:
                self._prefill_ran(out.rid)
            if out.finished:
                del self._streams[out.rid]
                self._end(out.rid)
                if stream.first_token_time is not None and out.output_tokens > 1:
                    self.metrics.tpot.observe((now - stream.first_token_time) / (out.output_tokens - 1))
                self.metrics.on_finished(out, stream.arrival, now, stream.first_token_time)
            stream.queue.put_nowait(out)

    async def _encode_deferred(self, rid: str) -> None:
        """The router wants the images this request was sent without (their KV is not in the prefix cache): encode
        them, then let it go on; on failure the request ends as prepare's failure would have ended it."""
        try:
            await self.preparer.encode_deferred(rid)
        except (BadRequest, ServerFailure) as e:
            stream = self._streams.pop(rid, None)
            if stream is not None:  # (else its client left, and its abort has been sent)
                self._abandon(rid)  # it waits in the router
                refused = isinstance(e, BadRequest)
                stream.queue.put_nowait(TextOutput(rid, "", [], True, "error", 0, 0, e.to_error()) if refused else e)
            return
        except Exception as e:  # a bug: the request must still end
            logger.exception("encoding the deferred images of %s failed", rid)
            self._to_router.send_nowait(ImagesReady(rid, error=repr(e)))
            return
        self._to_router.send_nowait(ImagesReady(rid))

    async def _watch_children(self) -> None:
        while True:
            for child in self.children:
                if not child.alive():
                    self.fatal(f"the {child.name} process exited (code {child.exitcode})")
                    return
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def fatal(self, reason: str) -> None:
        """The server cannot go on: fail every request in flight, /health fails, and the server exits non-zero."""
        logger.error("%s; failing in-flight requests and shutting down", reason)
        self.failure = reason
        self._failed.set()
        self._fail_all(reason)
        self.on_fatal()

    def _fail_all(self, reason: str) -> None:
        """Every request ends now: the router is gone or about to be stopped, so nothing reads any image more."""
        streams, self._streams = self._streams, {}
        abandoned, self._abandoned = self._abandoned, set()
        for rid in abandoned:
            self._end(rid)
        for rid, stream in streams.items():
            self._end(rid)
            stream.queue.put_nowait(ServerFailure(reason))


def _sub_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a group: seeded seed + i; the prompt is scored once (prompt_logprobs), by sequence 0."""
    if i == 0:
        return params
    seed = None if params.seed is None else (params.seed + i) % (1 << 63)
    return replace(params, seed=seed, prompt_logprobs=None)
