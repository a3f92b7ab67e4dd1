"""The operator's probes: /healthz and /readyz for a leader, a standby, one cut off from the API server, and one
whose kopf stopped; /metrics says which replica leads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import httpx
import kopf

from operator_procs import free_port
from pdpool.operator.health import Health
from pdpool.operator.kube import Kube
from pdpool.operator.leader import LeaseElector


async def probe(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status, await resp.text()


def test_probes_follow_the_crd_the_lease_and_kopf(cluster):
    async def scenario():
        port = free_port()
        health = Health(lease_seconds=1.0)
        await health.start("127.0.0.1", port)
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        try:
            assert (await probe(port, "/healthz"))[0] == 200
            status, body = await probe(port, "/readyz")
            assert status == 503 and "CRD" in body
            health.crd_served = True
            leader = LeaseElector(kube, "default", "health-1", "a", lease_seconds=1.0)
            standby = LeaseElector(kube, "default", "health-1", "b", lease_seconds=1.0)
            health.elector = standby
            assert (await probe(port, "/readyz"))[0] == 503, "the elector has not reached the API server yet"
            assert await leader.try_acquire_or_renew() and not await standby.try_acquire_or_renew()
            assert await probe(port, "/readyz") == (200, "standby\n")
            assert "pdpool_operator_leader 0.0" in (await probe(port, "/metrics"))[1]
            health.elector = leader
            assert await probe(port, "/readyz") == (200, "leading\n")
            metrics = (await probe(port, "/metrics"))[1]
            assert "pdpool_operator_leader 1.0" in metrics and "pdpool_operator_ready 1.0" in metrics
            leader.last_contact = time.monotonic() - 3.0  # the API server stopped answering two leases ago
            assert (await probe(port, "/readyz"))[0] == 503
            assert (await probe(port, "/healthz"))[0] == 200, "not ready is not dead"
            health.kopf_task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
            await health.kopf_task
            assert await probe(port, "/healthz") == (503, "kopf stopped\n")
        finally:
            await health.stop()
            await kube.close()

    asyncio.run(scenario())


def test_the_probes_answer_on_ipv4_and_ipv6_as_the_chart_runs_the_operator(cluster, tmp_path):
    """The chart gives no --health-host. It was 0.0.0.0, IPv4 only: in an IPv6-only cluster (EKS IPv6, say) the
    kubelet probes the pod's IPv6 address, so liveness failed and every replica was restarted forever."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", "operator", f"--health-port={port}",
                             "--no-leader-election", "--crd-wait-seconds", "0.3"],
                            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
                            stdout=open(tmp_path / "operator.log", "w"), stderr=subprocess.STDOUT)
    try:
        for host in ("127.0.0.1", "[::1]"):
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert httpx.get(f"http://{host}:{port}/healthz", timeout=2).status_code == 200
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, (host, (tmp_path / "operator.log").read_text())
                    time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(15)
