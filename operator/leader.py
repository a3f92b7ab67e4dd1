"""Leader election on a ``coordination.k8s.io/v1`` Lease, around kopf (kopf's peering only pauses operators).

client-go's algorithm: the holder renews ``spec.renewTime`` every ``renew_seconds``; another candidate takes the
Lease once it has seen the same record, unchanged, for ``leaseDurationSeconds`` by its own clock (so clocks
need not agree). Writes carry ``resourceVersion``: of two candidates racing for an expired Lease, one gets 409.
A leader that cannot renew within ``renew_deadline`` — or finds another holder — stops leading.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
import uuid

from pdpool.operator.kube import ApiError, Kube

log = logging.getLogger("pdpool.operator.leader")


def default_identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


def _micro_time() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(self, kube: Kube, namespace: str, name: str = "pdpool-operator", identity: str | None = None,
                 lease_seconds: float = 15.0, renew_seconds: float | None = None, retry_seconds: float | None = None):
        self.kube, self.namespace, self.name = kube, namespace, name
        self.identity = identity or default_identity()
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds or lease_seconds / 3
        self.retry_seconds = retry_seconds or lease_seconds / 5
        self.renew_deadline = lease_seconds * 2 / 3
        self._observed: tuple | None = None
        self._observed_at = 0.0
        self.holder: str | None = None
        self._renewed_at: float | None = None
        self.last_contact: float | None = None  # when the API server last answered (readiness)

    def is_leader(self) -> bool:
        """True while the last renewal is fresh: a paused or partitioned leader fences itself off in time."""
        return self._renewed_at is not None and time.monotonic() - self._renewed_at < self.renew_deadline

    def _spec(self, old: dict, now: str) -> dict:
        mine = old.get("holderIdentity") == self.identity
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.lease_seconds)),
                "acquireTime": old.get("acquireTime") if mine and old.get("acquireTime") else now, "renewTime": now,
                "leaseTransitions": (old.get("leaseTransitions") or 0) + (0 if mine else 1)}

    async def try_acquire_or_renew(self) -> bool:
        now = _micro_time()
        lease = await self.kube.get("Lease", self.namespace, self.name)
        self.last_contact = time.monotonic()
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec({}, now)}
            body["spec"]["leaseTransitions"] = 0
            try:
                await self.kube.create(body)
            except ApiError as exc:
                if exc.status == 409:
                    return False
                raise
            self.holder, self._renewed_at = self.identity, time.monotonic()
            return True
        spec = lease.get("spec") or {}
        self.holder = spec.get("holderIdentity")
        record = (self.holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        duration = spec.get("leaseDurationSeconds") or self.lease_seconds
        if self.holder and self.holder != self.identity and time.monotonic() - self._observed_at < duration:
            return False
        lease["spec"] = self._spec(spec, now)
        try:
            await self.kube.replace(lease)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        if self.holder != self.identity:
            log.info(f"{self.identity} acquired Lease {self.namespace}/{self.name} (was {self.holder})")
        self.holder, self._renewed_at = self.identity, time.monotonic()
        return True

    async def acquire(self) -> None:
        """Wait until this process leads."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    return
            except (ApiError, OSError, asyncio.TimeoutError) as exc:
                log.warning(f"Lease {self.name}: {exc}")
            await asyncio.sleep(self.retry_seconds)

    async def hold(self) -> None:
        """Renew until leadership is lost; then return."""
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                ok = await self.try_acquire_or_renew()
            except (ApiError, OSError, asyncio.TimeoutError) as exc:
                log.warning(f"renewing Lease {self.name}: {exc}")
                ok = False
            if not ok and ((self.holder and self.holder != self.identity) or not self.is_leader()):
                self._renewed_at = None
                log.error(f"{self.identity} lost Lease {self.namespace}/{self.name} (holder: {self.holder})")
                return

    async def release(self) -> None:
        """Hand the Lease over at once on a clean shutdown."""
        try:
            lease = await self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                await self.kube.replace(lease)
        except (ApiError, OSError, asyncio.TimeoutError) as exc:
            log.warning(f"releasing Lease {self.name}: {exc}")
