"""``AsyncLLM``: a server's engine loop, with the request front end and the output processor around it.

    event loop thread                                 engine thread (one worker)
    -----------------                                 --------------------------
    add_request: frontend.encode_prompt (text->ids) -> engine.add_request (validate, queue)
    _run: step N+1 is submitted before N's outputs are processed, so the engine computes while the loop
          detokenizes (OutputProcessor), finds stop strings and hands deltas to each request's stream
    stop strings / disconnects -> engine.abort_request (queued behind the running step)
    with no request running, the next step waits until requests stop arriving (``--arrival-wait-ms`` of quiet, at
    most ARRIVAL_MAX_WAIT_SECONDS; on CPU by default): a burst of requests is prefilled in one step, not the first
    one alone while the others wait out its prefill and then hold it back with theirs
    with no request for HEAP_TRIM_IDLE_SECONDS after some steps, the engine thread gives the C heap's free pages
    back to the OS (``utils.release_free_heap``), so an idle node's RSS falls back from its busy high-water mark

Every call into the engine runs on that one worker thread, so the engine needs no locks: an ``add_request``
lands between two steps. Text never touches the engine thread.

A request's stream aborts its request when the consumer stops early (client disconnect -> the handler is
cancelled -> ``CancelledError``/``GeneratorExit`` in the stream); its KV blocks go back to the pool. A step that
fails as a whole fails the requests it was running (``EngineStepError``) and the loop goes on; a request whose
own sampling failed ends alone (``RequestFailedError``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Protocol, Sequence

from pdpool.engine.llm_engine import EngineOutput, InvalidRequestError, LLMEngine
from pdpool.engine.output_processor import OutputProcessor, RequestOutput
from pdpool.engine.sampler import RequestFault
from pdpool.engine.sampling_params import SamplingParams, generation_defaults
from pdpool.engine.structured import Grammars
from pdpool.frontend import LONG_TEXT_CHARS, Frontend, ModelFiles, Tokenizer
from pdpool.utils import release_free_heap

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.01
ARRIVAL_QUIET_MS_CPU = 4.0  # a burst's requests reach the engine within a few ms of each other here
ARRIVAL_MAX_WAIT_SECONDS = 0.03
HEAP_TRIM_IDLE_SECONDS = 2.0  # this long with no request after some work: the freed C heap goes back to the OS


class LatencyObserver(Protocol):
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_finished(self, seconds: float) -> None: ...


class EngineStepError(RuntimeError):
    """A step failed as a whole; the requests it ran were aborted (the engine keeps serving)."""


class EngineClosedError(RuntimeError):
    """The engine is shut down."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (its batch-mates went on)."""


class _Timing:
    __slots__ = ("arrival", "last")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.last: float | None = None


class RequestStream:
    """The outputs (deltas) of one added request, in order; iterate it once."""

    def __init__(self, owner: "AsyncLLM", request_id: str, prompt_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids   # known before the first output (a stream's first chunk)
        self.prompt_cut = False       # truncate_prompt_tokens cut the prompt: its text is that of the kept ids
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False   # the request ended (nothing to abort)
        self._ended = False     # the consumer got its last item

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._ended:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = self._ended = True
                    raise item
                self._ended = item.finished
                self.finished = self.finished or item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it already finished; idempotent. A consumer still iterating gets the final
        output (``finish_reason`` "abort") after the outputs already queued."""
        if not self.finished:
            self.finished = True
            final = self._owner._abort_nowait(self.request_id)
            if final is not None:
                self._put(final)
        if self._owner._streams.get(self.request_id) is self:   # not a later request's under the same id
            del self._owner._streams[self.request_id]


class AsyncLLM:
    def __init__(self, node_config, *, latency_observer: LatencyObserver | None = None,
                 engine: LLMEngine | None = None, frontend: Frontend | None = None) -> None:
        self.engine = engine or LLMEngine(node_config)
        self.config = node_config
        path = self.engine.model_path
        self.frontend = frontend or Frontend(ModelFiles.read(path), Tokenizer(path, node_config.model.chat_template))
        self.engine.set_tokenizer_eos(self.frontend.tokenizer.eos_token_id)
        Grammars.of(self.frontend)
        self.generation_defaults = generation_defaults(path, node_config.model)   # the server applies them
        self.latency_observer = latency_observer
        self.output_processor = OutputProcessor(self.frontend.tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdpool-engine")
        self._streams: dict[str, RequestStream] = {}
        # ids whose engine abort is queued behind the step in flight, which still computes their old request
        self._aborting: dict[str, Future] = {}
        self._timings: dict[str, _Timing] = {}
        self._work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._closed = False
        self._heap_dirty = False  # steps ran since the last heap trim
        self.num_step_errors = 0
        wait_ms = node_config.scheduler.arrival_wait_ms
        if wait_ms is None:  # on CPU a prefill step takes seconds, so a few ms to gather a burst pay; not on CUDA
            wait_ms = ARRIVAL_QUIET_MS_CPU if node_config.device.device == "cpu" else 0.0
        self._arrival_quiet = wait_ms / 1000

    # ---- properties the server reads -------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def stats(self) -> dict[str, Any]:
        # Plain reads of counters and list lengths; safe while a step runs on the worker.
        return self.engine.stats()

    # ---- requests --------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                          priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                          kv_transfer_params: dict | None = None, add_special_tokens: bool = True,
                          prompt_token_ids: Sequence[int] | None = None) -> RequestStream:
        """Tokenize (unless ``prompt_token_ids`` are given: a router computed them), validate and add one
        request; raises ``InvalidRequestError``, ``SamplingParamsError``, ``QueueFullError``. Returns its stream."""
        try:
            ids, kept = await self._encode(request_id, prompt, params, add_special_tokens, prompt_token_ids)
        except BaseException:   # a refusal, or the client left (cancelled) while the prompt was tokenized
            self.engine.refuse_kv_transfer(kv_transfer_params)   # the engine never saw it: end its handle's lease
            raise
        cut = len(kept) < len(ids)
        if cut:
            ids, prompt = kept, kept      # the text (echo's) is then the kept ids'
        self._ensure_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(self, request_id, ids)
        stream.prompt_cut = cut
        self._streams[request_id] = stream
        self._timings[request_id] = _Timing(arrival)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, ids, params)
        try:
            await self._call(self.engine.add_request, request_id, ids, params, priority=priority,
                             cache_salt=cache_salt, arrival_time=arrival, kv_transfer_params=kv_transfer_params)
        except asyncio.CancelledError:
            # The add may still run on the worker; the abort queued behind it undoes it.
            self._abort_nowait(request_id)
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            self._timings.pop(request_id, None)
            self.output_processor.forget(request_id)
            raise
        assert self._work is not None
        self._work.set()
        return stream

    async def _encode(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                      add_special_tokens: bool, prompt_token_ids: Sequence[int] | None
                      ) -> tuple[list[int], list[int]]:
        """``add_request``'s front-end part: the prompt's ids, and those its options keep (``apply_prompt_options``;
        the same list when nothing is cut)."""
        self._check_admissible(request_id)
        source = prompt if prompt_token_ids is None else prompt_token_ids
        if isinstance(source, str) and len(source) >= LONG_TEXT_CHARS:   # off the loop, which serves every stream
            ids = await asyncio.to_thread(self.frontend.encode_prompt, source, add_special_tokens)
        else:
            ids = self.frontend.encode_prompt(source, add_special_tokens)
        while (aborting := self._aborting.get(request_id)) is not None:   # an earlier request of this id
            await asyncio.shield(asyncio.wrap_future(aborting))   # a cancelled add leaves the abort queued
        self._check_admissible(request_id)   # the engine closed, or the same id came in, meanwhile
        return ids, self.frontend.apply_prompt_options(ids, params, self.max_model_len)

    def _check_admissible(self, request_id: str) -> None:
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param=None)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, **kwargs)
        async for out in stream:
            yield out

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()
        else:
            await self._call(self.engine.abort_request, [request_id])

    async def call(self, fn, *args, **kwargs):
        """Run ``fn`` on the engine thread, between two steps (for engine reads that need consistency)."""
        return await self._call(fn, *args, **kwargs)

    # ---- loop ------------------------------------------------------------------------------------

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _abort_nowait(self, request_id: str) -> RequestOutput | None:
        """Abort one request without waiting for the engine; its final output ("abort"), if it had a state here."""
        self._timings.pop(request_id, None)
        final = self.output_processor.abort(request_id)
        if not self._closed:
            self._abort_in_engine([request_id])
        return final

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        """Queue the engine abort of requests whose streams are gone. Until it has run, each id waits to be used
        again: the step queued before it may still compute the old request, and its outputs are dispatched (and
        dropped: no stream) before a new request of that id is registered (one worker, FIFO; the loop runs the
        completions in order)."""
        future = self._executor.submit(self.engine.abort_request, request_ids)
        for rid in request_ids:
            self._aborting[rid] = future
        loop = asyncio.get_running_loop()

        def done(f: Future) -> None:
            try:
                loop.call_soon_threadsafe(self._aborted, request_ids, f)
            except RuntimeError:   # the loop is closed: no request comes in on it any more
                pass

        future.add_done_callback(done)

    def _aborted(self, request_ids: list[str], future: Future) -> None:
        for rid in request_ids:
            if self._aborting.get(rid) is future:
                del self._aborting[rid]

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._work = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="pdpool-engine-loop")

    def _submit_step(self) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)

    async def _run(self) -> None:
        assert self._work is not None
        pending: asyncio.Future | None = None
        idle = False
        # shutdown cancels this task, and also ends it here: asyncio.wait_for before Python 3.12 swallows a cancel that
        # comes in the turn where the wait for work ends (a wake or an add at the same time)
        while not self._closed:
            if pending is None:
                if not self.engine.has_unfinished_requests():
                    self._work.clear()
                    if not self._heap_dirty:
                        await self._work.wait()
                        continue
                    try:
                        await asyncio.wait_for(self._work.wait(), HEAP_TRIM_IDLE_SECONDS)
                    except asyncio.TimeoutError:  # idle: trim on the engine thread, between two steps
                        self._heap_dirty = False
                        await self._call(release_free_heap)
                    continue
                if self._arrival_quiet and not idle and not self.engine.scheduler.num_running:  # new requests only: a burst's first step
                    await self._gather_arrivals()
                pending = self._submit_step()
            try:
                outputs = await pending
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                pending = None
                self._fail_all(exc)
                await asyncio.sleep(0.01)
                continue
            pending = None
            self._heap_dirty = True
            idle = not outputs and not self.engine.last_step_num_scheduled  # e.g. all waiting for remote KV
            if not idle and self.engine.has_unfinished_requests():
                pending = self._submit_step()  # the engine computes the next step while we process this one
            self._dispatch(outputs)
            if idle:  # work exists but none could run: poll gently, wake on news
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), IDLE_POLL_SECONDS)
                except asyncio.TimeoutError:
                    pass

    async def _gather_arrivals(self) -> None:
        """No request running: wait while requests keep arriving (each within the quiet time of the last, for at
        most ARRIVAL_MAX_WAIT_SECONDS), so that requests sent together share their first step. A lone request pays
        the quiet time in TTFT; steps waiting on remote KV (idle) do not wait again."""
        assert self._work is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ARRIVAL_MAX_WAIT_SECONDS
        while (left := deadline - loop.time()) > 0:
            self._work.clear()
            try:
                await asyncio.wait_for(self._work.wait(), min(self._arrival_quiet, left))
            except asyncio.TimeoutError:
                return

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        results, stopped = self.output_processor.process(outputs)
        if stopped:  # stop strings: the engine still runs these requests
            self._abort_in_engine(stopped)
        now = time.monotonic()
        obs = self.latency_observer
        for out in results:
            timing = self._timings.get(out.request_id)
            if timing is not None:
                if out.new_token_ids and obs is not None:
                    if timing.last is None:
                        obs.on_first_token(now - timing.arrival)
                    else:
                        obs.on_inter_token(now - timing.last)
                    if out.finished:
                        obs.on_finished(now - timing.arrival)
                if out.new_token_ids:
                    timing.last = now
                if out.finished:
                    self._timings.pop(out.request_id, None)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason == "error":
                self._streams.pop(out.request_id, None)
                fault = out.error
                stream._put(InvalidRequestError(fault, param=fault.param) if isinstance(fault, RequestFault)
                            else RequestFailedError(fault or "the request failed in the engine"))
                continue
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, exc: Exception) -> None:
        self.num_step_errors += 1
        logger.error("engine step failed; aborting %d requests", len(self._streams), exc_info=exc)
        err = EngineStepError("the engine failed while running this request; it was aborted")
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.finished = True
            stream._put(err)
            self._timings.pop(rid, None)
            self.output_processor.forget(rid)
        self._executor.submit(self.engine.abort_all)  # also requests whose stream is gone

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """End one request's stream with ``exc`` (loop thread); the engine side aborts it on its own."""
        stream = self._streams.pop(request_id, None)
        self._timings.pop(request_id, None)
        self.output_processor.forget(request_id)
        if stream is not None:
            stream.finished = True
            stream._put(exc)

    def wake(self) -> None:
        """Tell the loop that something outside a step changed (a remote KV load finished); loop thread only."""
        if self._work is not None:
            self._work.set()

    async def shutdown(self) -> None:
        """Stop the loop, abort what is left (the connector waits out transfers), release the worker thread."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for rid in list(self._streams):
            self.fail_request(rid, EngineClosedError("the server is shutting down"))
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.abort_all)
        finally:
            self._executor.shutdown(wait=True)
