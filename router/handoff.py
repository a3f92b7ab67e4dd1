"""The request path: a routing decision, the prefill leg, the decode leg with retries, streaming, cancellation.

    plan -> [prefill: do_remote_decode, max_tokens 1, stream false] -> decode (+ kv_transfer_params) -> client
            prefill fails (connect, 5xx, 429, timeout)  -> decode-only on the same decode node ("fallback")
            prefill refuses the request (other 4xx)      -> the same: the decode node answers the client's request
            decode fails before its first byte          -> next decode node, at most --max-retries times; when
                                                           every one failed to connect or answer (dead, still
                                                           listed), a prefill node, decode-only, in those retries
            decode refuses the handle (4xx naming it)   -> the same decode node, decode-only
            decode fails after streaming started        -> a final SSE error event, then close
            client disconnects                          -> upstream connections closed (the nodes abort, the
                                                           prefill leg included), and a prefill lease the decode
                                                           node may not have reached is released at once
                                                           (POST .../notify {"release": true}); one the client
                                                           left mid-prefill may have had written is released by
                                                           its request id (POST .../responses/{id}/release)
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from pdpool.logs import HEADER as REQUEST_ID_HEADER
from pdpool.router import log_lines
from pdpool.router.request import RoutedRequest
from pdpool.router.scheduler import NoNodeError, RoutePlan
from pdpool.router.sse import SSERelay
from pdpool.router.upstream import TRANSPORT_ERRORS, ClientErrorReply, UpstreamError, busy_reply, classify_status
from pdpool.server import anthropic_messages
from pdpool.server.errors import APIError
from pdpool.server.stream_events import sse_frame

logger = logging.getLogger("pdpool.router")


def _cached_tokens(payload: dict | None) -> int | None:
    """A node's realized prefix hits: its usage's, a chat or completion's, a Response's or a Message's."""
    usage = (payload or {}).get("usage") if isinstance(payload, dict) else None
    details = None
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        if details is None and "cache_read_input_tokens" in usage:   # a Message's
            details = {"cached_tokens": usage["cache_read_input_tokens"]}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


class RequestPath:
    def __init__(self, scheduler, upstream, pool, index, inflight, metrics, *, max_retries: int,
                 prefill_timeout: float) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.pool = pool
        self.index = index
        self.inflight = inflight
        self.metrics = metrics
        self.max_retries = max_retries
        self.prefill_timeout = prefill_timeout
        # a node's 429 without its own Retry-After: the router leaves the node out this long (its cooldown)
        self.retry_after = str(max(1, math.ceil(pool.cooldown_seconds)))
        self._background: set[asyncio.Task] = set()

    # ---- bookkeeping --------------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _failed(self, endpoint, err: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(endpoint.node_id, err.kind).inc()
        self.pool.cool_down(endpoint.node_id, busy=err.kind == "http_429")
        if err.kind in ("connect", "timeout"):
            self.index.distrust(endpoint.node_id, endpoint.incarnation)  # maybe restarted: entries unproven
        logger.warning("%s leg on %s failed (%s): %s", endpoint.role, endpoint.node_id, err.kind, err)

    def _answered(self, endpoint) -> None:
        self.pool.recovered(endpoint.node_id)
        self.index.trust(endpoint.node_id)

    def _count_hits(self, role: str, rr: RoutedRequest, plan: RoutePlan, endpoint, realized: int | None) -> None:
        n = rr.num_prompt_tokens
        bs = self.scheduler.block_size
        predicted = min(plan.matched_blocks.get(endpoint.node_id, 0) * bs, (n - 1) // bs * bs)
        prompt_tokens, predicted_hits, realized_hits = self.metrics.hit_tokens[role]
        prompt_tokens.inc(n)
        predicted_hits.inc(predicted)
        if realized is not None:
            realized_hits.inc(realized)

    def _release(self, prefill, handle: dict | None, request_id: str) -> None:
        lease_id = (handle or {}).get("lease_id")
        if prefill is not None and isinstance(lease_id, str):
            self.metrics.lease_releases.inc()
            self._spawn(self.upstream.release_lease(prefill.url, lease_id, request_id))

    # ---- the path ---------------------------------------------------------------------------------------

    async def serve(self, exchange, rr: RoutedRequest) -> None:
        """Answer ``rr`` through ``exchange`` (``router/server.py``)."""
        try:
            plan = await self.scheduler.plan(rr.num_prompt_tokens, rr.block_hashes, disaggregable=rr.disaggregable)
        except NoNodeError as exc:
            wait = self.pool.busy_seconds()
            if wait is not None:   # left out for their 429s: the nodes are up and at capacity, so a 429 too
                raise _at_capacity(rr.path, wait) from None
            raise APIError(f"no ready node can serve the request: {exc}", status=503, code="no_ready_node") from None
        if plan.prefill is None:  # decode-only: its bookkeeping runs once the decode leg is on the wire
            return await self._decode(exchange, rr, plan, None, "decode_only")
        log_lines.info(logger, "route: prefill %s -> decode %s (matched blocks %s)", plan.prefill.node_id,
                       plan.decode[0].node_id, plan.matched_blocks)
        prefilled = await self._prefill(rr, plan)
        if prefilled is None:
            self._note(plan, "fallback")
            return await self._decode(exchange, rr, plan, None, None)
        # Counted once the decode node takes the handle: one it refuses makes this a fallback (``_decode``).
        handle, realized = prefilled
        return await self._decode(exchange, rr, plan, handle, "disaggregated", realized)

    def _note(self, plan: RoutePlan, decision: str) -> None:
        self.metrics.decision_seconds.observe(plan.seconds)
        if "affinity_yield" in plan.events:
            self.metrics.affinity_yields.inc()
        self.metrics.decisions[decision].inc()

    async def _prefill(self, rr: RoutedRequest, plan: RoutePlan) -> tuple[dict, int | None] | None:
        """The KV handle and the prefill node's realized prefix hits, or None when the request should go
        decode-only (also when the prefill node refused it: a 4xx for the client's own request comes from the
        decode node)."""
        p = plan.prefill
        body = rr.prefill_body(p.pdpool, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        if rr.parsed.params.min_tokens > 1:
            # min_tokens above that 1 is a 400 on the prefill node (a needless fallback): its one token is masked
            # (EOS, stop ids) with min_tokens 1 as with the client's; the decode node counts it toward the rest.
            body["min_tokens"] = 1
        ticket = self.inflight.add(p.node_id, rr.num_prompt_tokens - plan.matched_blocks.get(p.node_id, 0)
                                   * self.scheduler.block_size)
        self.index.record(plan.block_hashes, p)
        leg_id = rr.prefill_id()   # unique: its leases may be freed by it
        leg = asyncio.ensure_future(self.upstream.post_json(p.url + rr.prefill_path, body, leg_id,
                                                            timeout=self.prefill_timeout, client_headers=rr.headers))
        try:
            payload = await asyncio.shield(leg)
        except asyncio.CancelledError:
            # The client left mid-prefill: close the leg, so the node aborts a prefill nobody waits for (queued
            # behind others, it would hold blocks and compute for nothing; one that finished meanwhile has its
            # lease freed by the node on that abort). A leg that had answered already: free its lease here.
            leg.add_done_callback(lambda t: self._release_after(t, p, leg_id))
            if not leg.done():
                # Its answer may be written already and not read yet (then the node takes it as delivered and
                # its abort frees nothing): the node frees this response's leases, if it has any by now.
                leg.cancel()
                self._spawn(self.upstream.release_response(p.url, leg_id))
            raise
        except UpstreamError as err:
            self._failed(p, err)
            if err.status is None:
                # No error status from the node: its answer (the KV handle, a lease held for it) may have been
                # written and lost on the way (cut, reset or garbled by the network, or late past the prefill
                # timeout). The node took it as delivered and would hold the lease until it expires: free it now.
                self._spawn(self.upstream.release_response(p.url, leg_id))
            return None
        except ClientErrorReply:
            # The node refused the one-token request the router made of the client's (its message may name that
            # max_tokens 1): the decode leg sends the client's own, and its answer is the one the client sees.
            return None
        finally:
            ticket.done()
        self._answered(p)
        handle = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        if not isinstance(handle, dict):
            self._failed(p, UpstreamError("http_5xx", "the prefill answer has no kv_transfer_params"))
            return None
        return handle, _cached_tokens(payload)

    def _release_after(self, leg: asyncio.Future, prefill, request_id: str) -> None:
        if leg.cancelled() or leg.exception() is not None:
            return
        result = leg.result()
        self._release(prefill, result.get("kv_transfer_params") if isinstance(result, dict) else None, request_id)

    async def _decode(self, exchange, rr: RoutedRequest, plan: RoutePlan, handle: dict | None,
                      decision: str | None, prefill_realized: int | None = None) -> None:
        """``decision``: the decision to count once the first decode leg is sent (the node works on it
        meanwhile), or None when ``serve`` counted it already; "disaggregated" also counts the prefill leg's
        hits (``prefill_realized``), unless the decode node refuses the handle: then it is a "fallback"."""
        tries = plan.decode[:1 + self.max_retries]
        last: UpstreamError | None = None
        busy: ClientErrorReply | None = None   # the latest node's 429: the client's answer if no node answers
        all_unreachable = True   # every decode node tried failed at the connection: no status, no byte
        decode_only_again = -1   # the attempt that sends a refused handle's request decode-only: the fallback's own
        for attempt, d in enumerate(tries):
            if attempt and attempt != decode_only_again:
                self.metrics.decisions["retry"].inc()
                logger.info("retrying on %s node %s (attempt %d)", d.role, d.node_id, attempt + 1)
            changes = {"kv_transfer_params": handle} if handle is not None else {}
            hide_usage = False
            if rr.stream and d.pdpool and not rr.parsed.include_usage:
                changes["stream_options"] = {**(rr.body.get("stream_options") or {}), "include_usage": True}
                hide_usage = True
            body = rr.upstream_body(d.pdpool, **changes) if changes else rr.upstream_bytes(d.pdpool)
            relay = None if rr.stream else _Relay(exchange, rr.request_id)
            opened = self.upstream.send(d.url + rr.path, body, rr.request_id,   # on the wire when it can be
                                        on_complete=relay, client_headers=rr.headers)
            uncached = 0 if handle is not None else rr.num_prompt_tokens - plan.matched_blocks.get(
                d.node_id, 0) * self.scheduler.block_size
            ticket = self.inflight.add(d.node_id, uncached)
            self.index.record(plan.block_hashes, d)
            # The decision's metrics and log line wait until the answer is on its way (``_announce``): the node
            # often answers before the router would have got this far.
            note = [plan, decision, d, rr, prefill_realized] if decision is not None and not attempt else None
            try:
                return await self._decode_on(exchange, rr, plan, d, opened, hide_usage, ticket, note, relay)
            except UpstreamError as err:
                self._announce(note)
                last = err
                busy = err.reply or busy
                self._failed(d, err)
                if handle is not None:  # the next node prefills locally; free the lease now
                    self._release(plan.prefill, handle, rr.request_id)
                    handle = None
                all_unreachable = all_unreachable and err.status is None
                if all_unreachable and d.can_decode and attempt == len(tries) - 1 < self.max_retries:
                    # Dead decode nodes the discovery still lists (a heartbeat not expired yet): a prefill node
                    # serves the request whole, as once they have dropped out (``Pool.decode_candidates``).
                    spare = self._prefill_fallback(plan)
                    if spare is not None:
                        tries.append(spare)
            except _PassThrough as exc:   # the node refused the request (4xx)
                refused = handle is not None and b"kv_transfer_params" in exc.reply.body
                if refused and note:   # the KV served nothing: a fallback, without the prefill leg's hits
                    note[1] = "fallback"
                self._announce(note)
                if handle is None:
                    raise
                self._release(plan.prefill, handle, rr.request_id)
                if not refused:
                    raise
                # It refused the handle, the router's own field (the client cannot send one): a prefill node of
                # another version, or KV this node cannot read. Not the client's error: the same node, decode-only.
                logger.warning("decode node %s refused the KV handle of %s; decode-only: %s", d.node_id,
                               plan.prefill.node_id, exc.reply.body[:300])
                handle = None
                tries.insert(attempt + 1, d)
                decode_only_again = attempt + 1
            except BaseException:  # the client left
                self._announce(note)
                if handle is not None:
                    self._release(plan.prefill, handle, rr.request_id)
                raise
            finally:
                ticket.done()
        if busy is not None:   # a node at capacity: its 429 (and when to retry), not a 503
            raise _PassThrough(busy)
        raise APIError(f"every decode node tried failed; last: {last}", status=503, code="upstream_unavailable")

    def _prefill_fallback(self, plan: RoutePlan):
        """A usable prefill node to serve a request whole: the plan's own (it holds the prompt's prefix) first."""
        fp = self.scheduler.fingerprint()
        spare = [e for e in self.pool.whole_request_prefill_nodes() if self.scheduler.compatible(e, fp)]
        return plan.prefill if plan.prefill in spare else (spare[0] if spare else None)

    def _announce(self, note: list | None) -> None:
        """A decision's metrics, once, and a decode-only one's log line (``note``: [plan, decision, decode node,
        request, the prefill leg's realized hits])."""
        if note:
            plan, decision, d, rr, prefill_realized = note
            note.clear()
            self._note(plan, decision)
            if decision == "disaggregated":
                self._count_hits("prefill", rr, plan, plan.prefill, prefill_realized)
            elif decision == "decode_only":
                log_lines.info(logger, "route: decode-only %s (matched blocks %s)", d.node_id, plan.matched_blocks)

    async def _decode_on(self, exchange, rr, plan, d, opened, hide_usage, ticket, note, relay) -> None:
        resp = await opened
        try:
            kind = classify_status(resp.status)
            if kind or resp.status != 200:
                data = await _read_or(resp, b"")
                if kind:
                    busy = busy_reply(resp, data, self.retry_after) if resp.status == 429 else None
                    raise UpstreamError(kind, f"{d.node_id} answered {resp.status}: {data[:300]!r}", resp.status,
                                        busy)
                raise _PassThrough(ClientErrorReply(resp.status, data, resp.content_type))
            if not rr.stream:
                data = relay.body
                if data is None:      # not answered from the connection's callback (see _Relay)
                    try:
                        data = await resp.read()
                    except TRANSPORT_ERRORS as exc:
                        raise UpstreamError("stream_broken", f"{d.node_id}: {type(exc).__name__}: {exc}") from exc
                    exchange.respond(200, data, "application/json", {REQUEST_ID_HEADER: rr.request_id})
                ticket.prefill_done()   # the bookkeeping after the answer is on its way
                self._announce(note)
                self._answered(d)
                try:
                    payload = json.loads(data)
                except ValueError:
                    payload = None
                self._count_hits("decode", rr, plan, d, _cached_tokens(payload))
                return
            return await self._stream(exchange, rr, plan, d, resp, hide_usage, ticket, note)
        finally:
            resp.close()

    async def _stream(self, exchange, rr, plan, d, resp, hide_usage, ticket, note) -> None:
        relay = SSERelay(hide_usage)
        try:
            first = await resp.readany()
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError("stream_broken", f"{d.node_id} broke before its first byte: {exc}") from exc
        if not first:
            raise UpstreamError("stream_broken", f"{d.node_id} closed the stream before its first byte")
        ticket.prefill_done()
        self._answered(d)
        await exchange.start_stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          REQUEST_ID_HEADER: rr.request_id})
        error = None
        try:
            chunk = first
            while chunk:
                data = relay.feed(chunk)
                if data:
                    await exchange.write(data)
                if note:
                    self._announce(note)
                chunk = await resp.readany()
        except TRANSPORT_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not relay.done:
            tail = relay.tail()
            if tail:
                await exchange.write(tail)
            error = error or "the node closed the stream before [DONE]"
            self.metrics.upstream_errors.labels(d.node_id, "stream_broken").inc()
            self.pool.cool_down(d.node_id)
            logger.warning("decode stream from %s broke after it started: %s", d.node_id, error)
            err = APIError(f"upstream node failed mid-stream: {error}", status=502, type="internal_server_error",
                           code="upstream_stream_broken")
            if rr.path == anthropic_messages.PATH:   # Anthropic's error event
                event = b"event: error\ndata: " + json.dumps(err.anthropic_body()).encode() + b"\n\n"
            elif rr.path.endswith("/responses"):     # the Responses API's, numbered on from the node's events
                event = sse_frame({"type": "error", "sequence_number": relay.num_events, "code": err.code,
                                   "message": err.message, "param": None})
            else:
                event = b"data: " + json.dumps(err.body()).encode() + b"\n\n"
            await exchange.write((b"\n\n" if tail else b"") + event)
        self._count_hits("decode", rr, plan, d, _cached_tokens({"usage": relay.usage}))
        await exchange.end_stream()


class _Relay:
    """A node's whole 200 answer, sent to the client from the node connection's callback the moment it is read,
    before the request's task wakes (one loop iteration and the await chain off the serial path); the task then
    only keeps the books. ``body`` stays None when the answer is anything else: the task handles it as before."""

    __slots__ = ("exchange", "request_id", "body")

    def __init__(self, exchange, request_id: str) -> None:
        self.exchange = exchange
        self.request_id = request_id
        self.body: bytes | None = None

    def __call__(self, resp) -> None:
        if resp.status == 200 and not self.exchange.started:
            self.body = resp.take_body()
            self.exchange.respond(200, self.body, "application/json", {REQUEST_ID_HEADER: self.request_id})


class _PassThrough(Exception):
    """A node's own 4xx answer, for the client as is."""

    def __init__(self, reply: ClientErrorReply) -> None:
        super().__init__(str(reply))
        self.reply = reply


def _at_capacity(path: str, seconds: float) -> _PassThrough:
    wait = max(1, math.ceil(seconds))
    err = APIError(f"every node that can serve the request is at capacity (it answered 429); retry in {wait} s",
                   status=429, code="pool_at_capacity")
    return _PassThrough(ClientErrorReply(429, json.dumps(err.body_for(path)).encode(), "application/json",
                                         {"Retry-After": str(wait)}))


async def _read_or(resp, default: bytes) -> bytes:
    try:
        return await resp.read()
    except TRANSPORT_ERRORS:
        return default


def pass_through(exchange, exc: _PassThrough, request_id: str) -> None:
    r = exc.reply
    exchange.respond(r.status, r.body, r.content_type or "application/json",
                     {REQUEST_ID_HEADER: request_id, **r.headers} if r.headers else {REQUEST_ID_HEADER: request_id})
