"""The decode role's protocol: take over a request prefilled elsewhere.

1. ``on_add`` (engine thread): the handle in ``kv_transfer_params`` is validated and checked against this
   node's KV layout (a mismatch is a clear 400); the request gets ``kv_load`` and the prefill node's first
   token as its first output token.
2. The scheduler allocates the request's blocks (its own prefix-cache hit included, which is never pulled)
   and hands it over in ``kv_loads_to_start``; ``on_schedule`` starts one load task on the event loop.
3. The task (event loop): peer agent -> READ (pull) or ask the prefill node to WRITE (push) -> notify the
   prefill node -> the KV counts only if the lease was still held when the notification arrived.
4. ``before_step`` (engine thread) hands the outcome to the scheduler: loaded, or recompute locally
   (policy ``recompute``), or fail the request with an OpenAI error (policy ``fail``).

While a handoff waits here (queued behind other requests: ``max_num_seqs``, free blocks), this node renews its
lease at the prefill node (``POST /internal/kv/leases/renew``, batched per prefill node, at half the lease), so a
busy decode node never loses the prefill work to expiry; the release on pull, abort or disconnect is what frees
blocks, and expiry stays the safety net for a decode node that died. Renewal stops when the load starts.

Every wait is bounded by ``kv_transfer_timeout``. An abort while a transfer writes into the request's
blocks is deferred until the transfer has ended; an abort before it releases the prefill node's lease.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from pdpool import internal_api
from pdpool.block_hash import root_hash
from pdpool.engine.kv_connector import LoadPlan, plan_load, test_hooks_enabled
from pdpool.engine.llm_engine import InvalidRequestError, TokenLogprobs
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.scheduler import SchedulerOutput
from pdpool.kv_transfer.agent import KVTransferError
from pdpool.kv_transfer.handle import (IncompatibleKVError, KVFingerprint, KVHandle, KVHandleError,
                                       partial_block_hash)
from pdpool.decode_node.peers import LeaseRef, PeerDirectory

logger = logging.getLogger(__name__)

TEST_HOLD_KEY = "pdpool_test_hold"  # {"point": "before_transfer" | "after_transfer", "seconds": s}


class LeaseLostError(RuntimeError):
    """The prefill node no longer held (or could not confirm) the lease."""


@dataclass
class LoadJob:
    request_id: str
    handle: KVHandle
    deadline: float                   # local monotonic: received + the handle's remaining lease
    plan: LoadPlan | None = None
    started: bool = False
    cancelled: bool = False           # aborted while the transfer runs: abort once it ended
    lease_ended: bool = False         # notified the prefill node (or the lease is gone anyway)
    push_unanswered: bool = False     # asked for a push that did not answer: it may still write our blocks
    renew_at: float = 0.0             # local monotonic: when to renew the lease while queued (0: not yet set)
    test_hold: dict = field(default_factory=dict)


class DecodeSide:
    def __init__(self, engine, worker, peers: PeerDirectory, fingerprint: KVFingerprint, *, policy: str,
                 timeout: float, token: str | None, metrics, session_of, fail_request, wake) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.block_size = engine.kv_cache_manager.block_size
        self.worker = worker
        self.peers = peers
        self.fingerprint = fingerprint
        self.policy = policy
        self.timeout = timeout
        self.token = token
        self.metrics = metrics
        self.session_of = session_of
        self.fail_request = fail_request  # (request_id, message) on the event loop
        self.wake = wake                  # () on the event loop: the engine loop has news
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the server starts
        self.jobs: dict[str, LoadJob] = {}  # requests whose lease is not ended
        self.done: deque[tuple[str, str]] = deque()  # (request id, outcome), event loop -> engine thread
        self.tasks: set[asyncio.Task] = set()
        self.queued: dict[str, LoadJob] = {}  # event loop only: accepted jobs whose leases this node renews
        self._renewer: asyncio.Task | None = None
        self._renew_wake = None  # asyncio.Event, made on the loop
        self.first_logprobs: dict[str, TokenLogprobs] = {}  # the prefill node's first token, for the first output
        self.finished_by_first_token: dict[str, RequestStatus] = {}  # finish at the next step, nothing to load
        self.finished_outputs: list = []  # their outputs, added to the step's

    # ---- engine hooks (engine thread) ------------------------------------------------------------

    def wants(self, kv_transfer_params: dict) -> bool:
        return bool(kv_transfer_params.get("do_remote_prefill"))

    def on_add(self, request: Request, kv_transfer_params: dict) -> None:
        try:
            handle = KVHandle.from_dict(kv_transfer_params)
        except KVHandleError as exc:
            self.on_refused(kv_transfer_params)
            raise InvalidRequestError(f"invalid kv_transfer_params: {exc}", param="kv_transfer_params") from None
        if any(j.handle.lease_id == handle.lease_id for j in self.jobs.values()):
            raise InvalidRequestError("a KV handle serves one request (one prompt, n = 1)", param="kv_transfer_params")
        job = LoadJob(request.request_id, handle, time.monotonic() + handle.lease_remaining_s)
        try:
            self._check(request, handle)
        except InvalidRequestError:
            self._on_loop(self._end_lease, job)  # the prefill node need not hold blocks nobody will read
            raise
        num_logprobs = getattr(request.sampling_params, "logprobs", None)
        first_logprobs = _first_logprobs(handle, num_logprobs)
        if num_logprobs is not None and first_logprobs is None:
            # The prefill leg asked for fewer logprobs of its token than this request (a proxy that sends the legs
            # different fields): the prompt is computed here, as without a handle, so that every token has them.
            logger.info("request %s asks for %d logprobs a token; the KV handle of %s has fewer for its first token: "
                        "computing the prompt here", request.request_id, num_logprobs, handle.node_id)
            self._on_loop(self._end_lease, job)
            self.loop.call_soon_threadsafe(self.metrics.outcome, "recompute")
            return None
        request.append_output_token(handle.first_token_id)
        if first_logprobs is not None:
            self.first_logprobs[request.request_id] = first_logprobs
        status = self.scheduler.check_stop(request)
        if status is not None:  # EOS, a stop token id or max_tokens 1: the answer is complete, load nothing
            self._on_loop(self._end_lease, job)
            self.finished_by_first_token[request.request_id] = status
            return None
        if test_hooks_enabled():
            job.test_hold = dict(handle.extra.get(TEST_HOLD_KEY) or {})
        request.kv_load = job
        self.jobs[request.request_id] = job
        self._on_loop(self._keep_alive, job)
        return None  # the handle is not echoed back to the client

    def on_refused(self, kv_transfer_params: dict) -> None:
        """The request is refused (a bad handle here, or the engine's checks before ``on_add``): release the lease it
        names, if it names one, since the prefill node need not hold blocks nobody will read; not one a request in
        flight uses (a resent request refused as a duplicate carries its handle). Any thread."""
        lease = LeaseRef.of(kv_transfer_params)
        if lease is not None and all(j.handle.lease_id != lease.lease_id for j in list(self.jobs.values())):
            self._on_loop(self.peers.release, lease)

    def _check(self, request: Request, handle: KVHandle) -> None:
        try:
            handle.check_compatible(self.fingerprint)
        except IncompatibleKVError as exc:
            raise InvalidRequestError(str(exc), param="kv_transfer_params") from None
        if handle.first_token_id is None:
            raise InvalidRequestError("kv_transfer_params has no first_token_id", param="kv_transfer_params")
        top = (handle.first_token_logprobs or {}).get("top") or ()
        outside = [t for t in (handle.first_token_id, *(t for t, _ in top)) if t >= self.engine.vocab_size]
        if outside:
            raise InvalidRequestError(f"kv_transfer_params' first_token_id (or its top logprobs) names token "
                                      f"{outside[0]}, outside this model's vocabulary of {self.engine.vocab_size}",
                                      param="kv_transfer_params")
        if handle.num_tokens != request.num_prompt_tokens:
            raise InvalidRequestError(f"kv_transfer_params are for a prompt of {handle.num_tokens} tokens, this "
                                      f"one has {request.num_prompt_tokens}", param="kv_transfer_params")
        kv = self.engine.kv_cache_manager
        kv.update_block_hashes(request)
        num_full = request.num_prompt_tokens // self.block_size
        tail = partial_block_hash(request.prompt_token_ids, request.block_hashes, self.block_size,
                                  root_hash(kv.fingerprint, request.cache_salt))
        if ([h.hex() for h in request.block_hashes[:num_full]] != handle.block_hashes
                or tail != handle.partial_block_hash):
            raise InvalidRequestError("kv_transfer_params were made for a different prompt (block hashes differ)",
                                      param="kv_transfer_params")

    def on_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for request, num_hit_tokens, block_ids in scheduler_output.kv_loads_to_start:
            job: LoadJob = request.kv_load
            job.plan = plan_load(job.handle, num_hit_tokens, block_ids, self.block_size)
            job.started = True
            self._on_loop(self._load, job)

    def before_step(self) -> None:
        self._finish_by_first_token()
        while self.done:
            rid, outcome = self.done.popleft()
            job = self.jobs.pop(rid, None)
            if job is None:
                continue
            if job.cancelled or outcome == "fail":
                self.engine.abort_request(rid)  # frees the blocks now that no transfer writes them
            else:
                self.scheduler.finish_remote_load(rid, outcome == "ok")

    def after_step(self, outputs) -> None:
        outputs.extend(self.finished_outputs)
        self.finished_outputs = []
        if not self.first_logprobs:
            return
        for out in outputs:
            lp = self.first_logprobs.pop(out.request_id, None)
            if lp is not None:  # the request's first output: its tokens start with the prefill node's
                out.new_logprobs = [lp, *(out.new_logprobs or ())]

    def _finish_by_first_token(self) -> None:
        """Finish the requests whose first token ended them (before the schedule, so none is scheduled); their
        outputs go out with this step's."""
        pending, self.finished_by_first_token = self.finished_by_first_token, {}
        for rid, status in pending.items():
            out = self.engine.finish_request(rid, status)
            if out is not None:
                self.finished_outputs.append(out)

    def on_abort(self, request_ids: list[str]) -> set[str]:
        deferred = set()
        for rid in request_ids:
            self.first_logprobs.pop(rid, None)
            self.finished_by_first_token.pop(rid, None)
            job = self.jobs.get(rid)
            if job is None:
                continue
            if job.started:
                job.cancelled = True
                deferred.add(rid)
            else:
                del self.jobs[rid]
                self._on_loop(self._end_lease, job)
        return deferred

    def _on_loop(self, fn, arg) -> None:
        assert self.loop is not None, "the decode side needs the server's event loop"
        self.loop.call_soon_threadsafe(self._spawn, fn, arg)

    def _spawn(self, fn, arg) -> None:
        task = self.loop.create_task(fn(arg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- lease renewal while queued (event loop) ----------------------------------------------------

    async def _keep_alive(self, job: LoadJob) -> None:
        """Renew ``job``'s lease until its load starts or the lease ends (one renewer task for all jobs)."""
        job.renew_at = job.deadline - job.handle.lease_remaining_s / 2
        self.queued[job.request_id] = job
        if self._renew_wake is None:
            self._renew_wake = asyncio.Event()
        self._renew_wake.set()
        if self._renewer is None or self._renewer.done():
            self._renewer = self.loop.create_task(self._renew_loop())

    def stop_renewing(self) -> None:
        """On the event loop, when the node stops: its leases are released or expire on their own."""
        if self._renewer is not None:
            self._renewer.cancel()

    async def _renew_loop(self) -> None:
        while self.queued:
            now = time.monotonic()
            due: dict[tuple[str, int], list[LoadJob]] = {}
            for rid, job in list(self.queued.items()):
                if job.started or job.lease_ended or job.cancelled:
                    del self.queued[rid]
                elif job.renew_at <= now:
                    due.setdefault((job.handle.remote_host, job.handle.remote_port), []).append(job)
            if due:
                await asyncio.gather(*(self._renew(jobs) for jobs in due.values()))
                continue
            if not self.queued:
                break
            self._renew_wake.clear()
            wait = min(job.renew_at for job in self.queued.values()) - time.monotonic()
            try:
                await asyncio.wait_for(self._renew_wake.wait(), timeout=max(0.01, wait))
            except asyncio.TimeoutError:
                pass

    async def _renew(self, jobs: list[LoadJob]) -> None:
        h = jobs[0].handle
        url = internal_api.url(h.remote_host, h.remote_port, "kv/leases/renew")
        sent = time.monotonic()
        try:
            await self.peers.vouch(h)
            async with self.session_of().post(url, json={"lease_ids": [j.handle.lease_id for j in jobs]},
                                              headers=internal_api.headers(self.token),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                reply = await resp.json(content_type=None)
                if resp.status != 200:
                    raise KVTransferError(f"renew at {h.node_id} answered {resp.status}: {reply}")
            renewed = reply["renewed"]
        except Exception as exc:  # noqa: BLE001 - the leases run on; try again soon
            logger.info("could not renew %d leases at %s: %s", len(jobs), h.node_id, exc)
            for job in jobs:
                job.renew_at = time.monotonic() + max(0.05, job.handle.lease_remaining_s / 8)
            return
        for job in jobs:
            remaining = renewed.get(job.handle.lease_id)
            if remaining is None:  # gone at the prefill node: the load will recompute without reading
                job.deadline = sent
                job.renew_at = float("inf")
                self.queued.pop(job.request_id, None)
            else:
                job.deadline = sent + float(remaining)
                job.renew_at = job.deadline - job.handle.lease_remaining_s / 2

    # ---- the load (event loop) -------------------------------------------------------------------

    async def _load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._transfer(job), timeout=self.timeout * 3)
            outcome = "ok"
            self.metrics.latency.observe(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - every failure takes the policy's path
            outcome = "recompute" if self.policy == "recompute" else "fail"
            logger.warning("KV load of %s from %s failed (%s: %s); %s", job.request_id, job.handle.node_id,
                           type(exc).__name__, exc, outcome)
            if not job.lease_ended:
                self._spawn(self._end_lease, job)
            if outcome == "fail" and not job.cancelled:
                self.fail_request(job.request_id, f"KV transfer from prefill node {job.handle.node_id} failed "
                                                  f"({type(exc).__name__}: {exc}); --kv-load-failure-policy is fail")
        if not job.cancelled:
            self.metrics.outcome(outcome)
        if job.push_unanswered:  # the prefill node's WRITE is bounded by its --kv-transfer-timeout (the pool's)
            await asyncio.sleep(self.timeout)
        self.done.append((job.request_id, outcome))
        self.wake()

    async def _transfer(self, job: LoadJob) -> None:
        handle, plan = job.handle, job.plan
        if not plan.local_ids:  # all of it is in the local prefix cache
            await self._end_lease(job)
            return
        with self.worker.agent.using(handle.agent_name):  # the peer sweep leaves the agent loaded meanwhile
            peer = await self.peers.agent(handle)
            await self._hold(job, "before_transfer")
            if job.cancelled:
                raise LeaseLostError("the request was aborted before its transfer; lease released")
            if time.monotonic() >= job.deadline:
                raise LeaseLostError("the lease ran out before the transfer started")
            if test_hooks_enabled():
                self.worker.fill_garbage(plan.local_ids)
            if handle.transfer_mode == "push":
                held = await self._push(job, peer)
            else:
                await self.worker.pull(peer, plan.remote_ids, plan.local_ids)
                await self._hold(job, "after_transfer")
                held = await self._notify(job)
        if not held:
            raise LeaseLostError("the prefill node no longer held the lease when notified")

    async def _hold(self, job: LoadJob, point: str) -> None:
        if job.test_hold.get("point") == point:
            await asyncio.sleep(float(job.test_hold.get("seconds", 0)))

    async def _notify(self, job: LoadJob) -> bool:
        job.lease_ended = True  # whatever the answer, the prefill node frees the blocks
        reply = await self.peers.post(job.handle, "notify", {"binding": job.handle.binding()})
        return bool(reply.get("held"))

    async def _push(self, job: LoadJob, peer: str) -> bool:
        job.lease_ended = True
        body = {"agent_metadata": base64.b64encode(self.worker.metadata()).decode(),
                "block_ids": job.plan.local_ids, "remote_block_ids": job.plan.remote_ids,
                "binding": job.handle.binding()}
        job.push_unanswered = True
        try:
            reply = await self.peers.post(job.handle, "push", body)
        except KVTransferError as exc:
            if isinstance(exc.__cause__, aiohttp.ClientConnectorError):
                job.push_unanswered = False  # it never reached the prefill node
            raise
        job.push_unanswered = False
        await self._hold(job, "after_transfer")
        return bool(reply.get("held"))

    async def _end_lease(self, job: LoadJob) -> None:
        job.lease_ended = True
        await self.peers.release(job.handle)


def _first_logprobs(handle: KVHandle, num_logprobs: int | None) -> TokenLogprobs | None:
    """The first token's logprobs from ``handle`` for a request asking for ``num_logprobs`` top ones a token (None:
    no logprobs); None also when the handle has fewer (its prefill leg asked for fewer)."""
    lp = handle.first_token_logprobs
    if num_logprobs is None or lp is None:
        return None
    top = lp.get("top") or []
    if len(top) < num_logprobs:
        return None
    return TokenLogprobs(handle.first_token_id, float(lp["logprob"]),
                         [(int(t), float(v)) for t, v in top[:num_logprobs]])
