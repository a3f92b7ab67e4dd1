"""The prefill node's lease table: KV blocks held for a decode node, until notified or expired.

Pure Python, changed only on the engine thread (HTTP handlers reach it through ``AsyncLLM.call``); a scrape of
``/metrics`` reads ``num_leased_blocks`` and ``len(leases)`` from another thread, so both are kept as plain values
(never an iteration over the dict, which the engine thread may change meanwhile). A lease
ends exactly once, by the first of:

* ``notify(lease_id)``: the decode node finished its pull (or gave up); answers whether the lease was still
  held when the notification arrived — the decode node uses the pulled KV only on True;
* ``expire(now)``: its duration ran out (monotonic clock of this node only; peers get relative times).

``renew(lease_id)`` starts a held lease's duration again: a decode node keeps alive the leases of handoffs it
has accepted and queued, so expiry only frees the blocks of a decode node that stopped renewing (it died, or
lost the request without telling us).

The engine's blocks are released by the caller (``scheduler.release_held_blocks``) for every ended lease.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: list[int]
    expires_at: float  # time.monotonic() of this node
    binding: str | None = None  # the issued handle's ``KVHandle.binding()``, checked at notification and push


class LeaseTable:
    """``max_blocks`` caps blocks under lease plus blocks reserved by requests still prefilling."""

    def __init__(self, lease_seconds: float, max_blocks: int | None = None, clock=time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self.max_blocks = max_blocks
        self.clock = clock
        self.leases: OrderedDict[str, Lease] = OrderedDict()  # in expiry order (one duration for all)
        self.reserved: dict[str, int] = {}  # request id -> blocks it will hold once prefilled
        self.num_expired = 0
        self.num_notified = 0
        self.num_renewed = 0
        self.num_leased_blocks = 0  # sum over leases, kept up to date by issue/notify/expire
        self._by_request: dict[str, str] = {}  # request id -> its live lease's id

    def reserve(self, request_id: str, num_blocks: int) -> bool:
        """Count a prefill's blocks against the cap before it runs; False when they do not fit."""
        if self.max_blocks is not None:
            if self.num_leased_blocks + sum(self.reserved.values()) + num_blocks > self.max_blocks:
                return False
        self.reserved[request_id] = num_blocks
        return True

    def unreserve(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)

    def issue(self, request_id: str, block_ids: list[int]) -> Lease:
        self.reserved.pop(request_id, None)
        lease = Lease(uuid.uuid4().hex, request_id, list(block_ids), self.clock() + self.lease_seconds)
        self.leases[lease.lease_id] = lease
        self._by_request[request_id] = lease.lease_id
        self.num_leased_blocks += len(lease.block_ids)
        return lease

    def lease_of(self, request_id: str) -> str | None:
        """The id of the request's lease while it is in the table."""
        return self._by_request.get(request_id)

    def leases_of_response(self, response_id: str) -> list[str]:
        """The leases of the engine requests behind one API response: its ``X-Request-Id`` is their ids' prefix
        (``<response id>-<8 hex>-<choice>``, ``pdpool.server.serving``), matched whole."""
        return [lease_id for rid, lease_id in self._by_request.items() if rid.rsplit("-", 2)[0] == response_id]

    def remaining(self, lease: Lease) -> float:
        return max(0.0, lease.expires_at - self.clock())

    def get(self, lease_id: str) -> Lease | None:
        """The lease if it is still held (not expired by the clock, even if ``expire`` has not run yet)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.expires_at <= self.clock():
            return None
        return lease

    def renew(self, lease_id: str) -> Lease | None:
        """A full duration again from now, if the lease is still held; None otherwise."""
        lease = self.get(lease_id)
        if lease is None:
            return None
        lease.expires_at = self.clock() + self.lease_seconds
        self.leases.move_to_end(lease_id)  # expiry order still holds: one duration for all, from now
        self.num_renewed += 1
        return lease

    def notify(self, lease_id: str) -> tuple[bool, Lease | None]:
        """End the lease on the decode node's word: (was it held, the lease whose blocks to release)."""
        lease = self.get(lease_id)
        if lease is None:
            return False, None
        del self.leases[lease_id]
        self._by_request.pop(lease.request_id, None)
        self.num_leased_blocks -= len(lease.block_ids)
        self.num_notified += 1
        return True, lease

    def expire(self) -> list[Lease]:
        now = self.clock()
        ended = []
        while self.leases:
            lease = next(iter(self.leases.values()))
            if lease.expires_at > now:
                break
            del self.leases[lease.lease_id]
            self._by_request.pop(lease.request_id, None)
            self.num_leased_blocks -= len(lease.block_ids)
            ended.append(lease)
        self.num_expired += len(ended)
        return ended
