"""The Lease elector in-process against the emulator: acquire, renew, take over only after a lease, release."""

from __future__ import annotations

import asyncio
import time

import kopf
import pytest

from pdpool.operator.kube import Kube, NotLeader
from pdpool.operator.leader import LeaseElector


@pytest.fixture
def kube(cluster):
    return Kube(kopf.ConnectionInfo(server=cluster.emulator.url))


def test_takeover_only_after_an_unrenewed_lease_and_at_once_after_release(cluster, kube):
    async def scenario():
        a = LeaseElector(kube, "default", "elect-1", "a", lease_seconds=1.0)
        b = LeaseElector(kube, "default", "elect-1", "b", lease_seconds=1.0)
        assert await a.try_acquire_or_renew() and a.is_leader()
        for _ in range(4):  # a renews: b never gets it
            await asyncio.sleep(0.3)
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew() and b.holder == "a"
        stopped = time.monotonic()  # a stops renewing
        while not await b.try_acquire_or_renew():
            await asyncio.sleep(0.05)
        waited = time.monotonic() - stopped
        assert 1.0 <= waited < 1.5, waited
        assert not await a.try_acquire_or_renew() and a.holder == "b"
        lease = await kube.get("Lease", "default", "elect-1")
        assert lease["spec"]["leaseTransitions"] == 1 and lease["spec"]["leaseDurationSeconds"] == 1
        await b.release()
        assert await a.try_acquire_or_renew(), "a released Lease is free at once"
        await kube.close()

    asyncio.run(scenario())


def test_a_leader_that_stopped_renewing_is_fenced(cluster, kube):
    async def scenario():
        elector = LeaseElector(kube, "default", "elect-2", "a", lease_seconds=0.6)
        fenced = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        fenced.fence = elector.is_leader
        with pytest.raises(NotLeader):
            await fenced.get("Lease", "default", "elect-2")
        assert await elector.try_acquire_or_renew()
        assert await fenced.get("Lease", "default", "elect-2")
        await asyncio.sleep(elector.renew_deadline)
        with pytest.raises(NotLeader):
            await fenced.get("Lease", "default", "elect-2")
        await fenced.close()
        await kube.close()

    asyncio.run(scenario())
