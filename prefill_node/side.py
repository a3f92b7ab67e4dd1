"""The prefill role's protocol: hold a request's KV under a lease, hand out the KV handle, end leases.

Engine thread (through ``KVConnector``): a request with ``kv_transfer_params.do_remote_decode`` reserves its
blocks against ``max_leased_blocks`` (429 beyond it) and keeps them when it finishes; the finished output's
``kv_transfer_params`` becomes the handle. Leases end on the decode node's notification or on expiry; the decode
node renews the leases of handoffs queued there.
HTTP side: ``prefill_node.routes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdpool.block_hash import root_hash
from pdpool.engine.request import Request
from pdpool.engine.scheduler import SchedulerOutput
from pdpool.kv_transfer.handle import KVFingerprint, KVHandle, partial_block_hash
from pdpool.prefill_node.leases import Lease, LeaseTable
from pdpool.server.errors import APIError
from pdpool.utils import cdiv

logger = logging.getLogger(__name__)

# The handle promises less than the lease holds: the handle travels (proxy, queues) before a decode node
# reads it, and the peers share no clock. The confirmation at notification is what makes a pull safe.
LEASE_SAFETY_MARGIN = 0.2


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    incarnation: str
    agent_name: str
    host: str
    port: int


class LeaseCapError(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=429, code="kv_lease_cap")


class PrefillSide:
    def __init__(self, engine, identity: NodeIdentity, fingerprint: KVFingerprint, rank_layouts, *,
                 lease_seconds: float, max_leased_blocks: int | None, transfer_mode: str, metrics) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.block_size = engine.kv_cache_manager.block_size
        self.identity = identity
        self.fingerprint = fingerprint
        self.rank_layouts = rank_layouts
        self.transfer_mode = transfer_mode
        self.table = LeaseTable(lease_seconds, max_leased_blocks)
        self.prefilling: dict[str, Request] = {}  # do_remote_decode requests not finished yet
        self.metrics = metrics
        metrics.leased_blocks = lambda: self.table.num_leased_blocks
        metrics.num_leases = lambda: len(self.table.leases)

    # ---- engine hooks ----------------------------------------------------------------------------

    def wants(self, kv_transfer_params: dict) -> bool:
        return bool(kv_transfer_params.get("do_remote_decode"))

    def on_refused(self, kv_transfer_params: dict) -> None:
        """Nothing to end: a prefill request holds nothing before ``on_add``."""

    def on_add(self, request: Request, kv_transfer_params: dict) -> dict:
        num_blocks = cdiv(request.num_prompt_tokens + (request.max_tokens or 1) - 1, self.block_size)
        if not self.table.reserve(request.request_id, num_blocks):
            raise LeaseCapError(f"this prefill node holds its maximum of {self.table.max_blocks} KV blocks "
                                f"under lease; retry later or on another node")
        request.hold_blocks_on_finish = True
        self.prefilling[request.request_id] = request
        return kv_transfer_params

    def on_schedule(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def before_step(self) -> None:
        self.expire_leases()

    def after_step(self, outputs) -> None:
        for out in outputs:
            if not out.finished or out.request_id not in self.prefilling:
                continue
            request = self.prefilling.pop(out.request_id)
            block_ids = self.scheduler.held_blocks.get(out.request_id)
            if block_ids is None:  # finished without holding (nothing to hand over)
                self.table.unreserve(out.request_id)
                continue
            lease = self.table.issue(out.request_id, block_ids)
            handle = self._handle(request, lease, out)
            lease.binding = handle.binding()
            out.kv_transfer_params = handle.to_dict()

    def on_abort(self, request_ids: list[str]) -> set[str]:
        for rid in request_ids:
            self.table.unreserve(rid)
            self.prefilling.pop(rid, None)
            lease_id = self.table.lease_of(rid)
            if lease_id is not None:
                # It finished (lease issued) in a step whose output its client never took: the abort comes from a
                # stream that stopped waiting (client gone), so the handle is never delivered. Free it now.
                logger.info("lease %s: request %s aborted before its handle was delivered; releasing it",
                            lease_id, rid)
                self.notify(lease_id)
        return set()

    # ---- leases (engine thread) ------------------------------------------------------------------

    def expire_leases(self) -> int:
        ended = self.table.expire()
        for lease in ended:
            logger.info("lease %s of request %s expired; %d blocks freed", lease.lease_id, lease.request_id,
                        len(lease.block_ids))
            self.scheduler.release_held_blocks(lease.request_id)
        self.metrics.lease_expiries += len(ended)
        return len(ended)

    def notify(self, lease_id: str, binding: str | None = None) -> bool:
        """The decode node is done with the lease: was it still held, for the handle it was issued with (its
        ``binding``, when the caller read by it)? Frees its blocks either way."""
        self.expire_leases()
        held, lease = self.table.notify(lease_id)
        if lease is not None:
            self.scheduler.release_held_blocks(lease.request_id)
            if binding is not None and binding != lease.binding:
                logger.warning("lease %s: notified for a handle it was not issued with (edited or forged); "
                               "released, not held", lease_id)
                return False
        return held

    def release_response(self, response_id: str) -> int:
        """The router's client left while this response's prefill was on its way back (``X-Request-Id``
        ``response_id``): free its leases, if it has any by now. A prefill still running is aborted by the closed
        connection instead (``on_abort``)."""
        lease_ids = self.table.leases_of_response(response_id)
        for lease_id in lease_ids:
            logger.info("lease %s: the router's client left as request %s's handle went out; releasing it",
                        lease_id, response_id)
            self.notify(lease_id)
        return len(lease_ids)

    def renew(self, lease_ids: list[str]) -> dict[str, float]:
        """The decode node still wants these leases: {lease id: seconds it may count on} for those still held."""
        self.expire_leases()
        renewed = {}
        for lease_id in lease_ids:
            lease = self.table.renew(lease_id)
            if lease is not None:
                renewed[lease_id] = round(self.table.remaining(lease) * (1 - LEASE_SAFETY_MARGIN), 6)
        self.metrics.lease_renewals += len(renewed)
        return renewed

    def lease_blocks(self, lease_id: str, binding: str | None = None) -> list[int] | None:
        """The held lease's blocks; None when it is gone or ``binding`` is not the issued handle's."""
        lease = self.table.get(lease_id)
        if lease is None or (binding is not None and binding != lease.binding):
            return None
        return list(lease.block_ids)

    def release_all(self) -> None:
        for lease_id in list(self.table.leases):
            self.notify(lease_id)

    # ---- the handle ------------------------------------------------------------------------------

    def _handle(self, request: Request, lease: Lease, out) -> KVHandle:
        n, bs = request.num_prompt_tokens, self.block_size
        kv = self.engine.kv_cache_manager
        kv.update_block_hashes(request)
        tail = partial_block_hash(request.prompt_token_ids, request.block_hashes, bs,
                                  root_hash(kv.fingerprint, request.cache_salt))
        first_logprobs = None
        if out.new_logprobs:  # the request finishes on its first (only) token
            lp = out.new_logprobs[0]
            first_logprobs = {"token_id": lp.token_id, "logprob": lp.logprob,
                              "top": [[t, v] for t, v in lp.top] if lp.top is not None else None}
        ident = self.identity
        return KVHandle(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=ident.node_id,
            remote_block_ids=lease.block_ids[:cdiv(n, bs)], remote_host=ident.host, remote_port=ident.port,
            node_id=ident.node_id, incarnation=ident.incarnation, agent_name=ident.agent_name,
            lease_id=lease.lease_id,
            lease_remaining_s=round(self.table.remaining(lease) * (1 - LEASE_SAFETY_MARGIN), 6),
            block_hashes=[h.hex() for h in request.block_hashes[:n // bs]], num_tokens=n, partial_block_hash=tail,
            fingerprint=self.fingerprint, rank_layouts=list(self.rank_layouts), transfer_mode=self.transfer_mode,
            first_token_id=request.output_token_ids[0], first_token_logprobs=first_logprobs)
