"""A child the cluster's admission policy denies (Gatekeeper, Kyverno: a validating webhook answers 403 Forbidden,
'admission webhook ... denied the request: ...') is the pool's Degraded condition, with the policy's message.

The operator runs behind a proxy in front of the emulator that plays such a webhook for Deployments named
``policed-*`` while the policy is on; the test's kubectl talks to the emulator directly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from k8s_tools import write_kubeconfig
from operator_procs import OperatorProcess, free_port, posted_within, wait_until
from operator_examples import ROOT

POOL = "inferencepools.pdpool.io"
DENIAL = ('admission webhook "limits.policy.example.com" denied the request: container node of Deployment '
          'policed-decode must set resources.limits.cpu')


class WebhookProxy:
    """Forwards every request (watches streamed) to ``upstream``; refuses writes of policed Deployments with 403."""

    def __init__(self, upstream: str):
        self.upstream, self.enforcing, self.port = upstream, True, free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _denies(self, request: web.Request, body: bytes) -> bool:
        if not self.enforcing or request.method not in ("POST", "PATCH", "PUT") or "/deployments" not in request.path:
            return False
        name = request.path.rsplit("/", 1)[-1] if request.method != "POST" else json.loads(body)["metadata"]["name"]
        return name.startswith("policed-")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self._denies(request, body):
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                      "reason": "Forbidden", "message": DENIAL}, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                        headers=headers) as resp:
            out = web.StreamResponse(status=resp.status,
                                     headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client ended its watch
                pass
            return out

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._forward)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self.loop.run_until_complete(start())
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def stop():
            await self.runner.cleanup()
            await self.session.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def policed(cluster, k8s_module, tmp_path_factory):
    cluster.kubectl("apply", "-f", str(ROOT / "operator" / "crd.yaml"))
    tmp = tmp_path_factory.mktemp("admission")
    proxy = WebhookProxy(k8s_module.url)
    proc = OperatorProcess(write_kubeconfig(tmp / "kubeconfig", f"http://127.0.0.1:{proxy.port}"), tmp, "op-policed")
    yield proxy
    proc.stop()
    proxy.stop()


def degraded(cluster, name: str) -> dict:
    pool = cluster.kubectl.json("get", POOL, name)
    return next((c for c in (pool.get("status") or {}).get("conditions") or [] if c["type"] == "Degraded"), {})


def test_a_child_an_admission_webhook_denies_is_degraded_with_the_policys_message(cluster, policed):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "policed"}, "spec": {}}))
    wait_until(lambda: degraded(cluster, "policed").get("status") == "True", timeout=15, what="Degraded")
    condition = degraded(cluster, "policed")
    assert condition["reason"] == "ChildRejected" and DENIAL in condition["message"], condition
    time.sleep(11)  # past the change handler's old retry delay (10 s), which posted the Warning again each time
    events = [e for e in cluster.kubectl.json("get", "events")["items"]
              if e["involvedObject"].get("name") == "policed" and e["reason"] == "ChildRejected"]
    assert events and DENIAL in events[0]["message"], events
    assert posted_within(events) < 5, events  # once, not again on every retry (kopf may post twice on a slow answer)
    policed.enforcing = False  # the policy is changed (or the pool made to comply): the operator catches up
    wait_until(lambda: degraded(cluster, "policed").get("status") == "False", timeout=15, what="not Degraded")
    assert cluster.kubectl.json("get", "deployment", "policed-router")
    cluster.kubectl("delete", POOL, "policed", "--timeout=20s")
