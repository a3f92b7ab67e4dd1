"""The cluster's admission policies (Gatekeeper, Kyverno). A child a validating webhook denies (403 Forbidden,
'admission webhook ... denied the request: ...') is the pool's Degraded condition, with the policy's message; a
field a mutating webhook rewrites is not fought on every status tick.

The operator runs behind a proxy in front of the emulator that plays such webhooks for Deployments named
``policed-*`` (while the policy is on) and ``mutated-*``; the test's kubectl talks to the emulator directly.
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

    @staticmethod
    def _mutated(request: web.Request, body: bytes) -> bytes:
        """A mutating policy (Kyverno's 'always pull images', say) on Deployments named ``mutated-*``."""
        if request.method not in ("POST", "PATCH", "PUT") or "/deployments" not in request.path or not body:
            return body
        obj = json.loads(body)
        name = request.path.rsplit("/", 1)[-1] if request.method != "POST" else obj["metadata"]["name"]
        containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers")
        if not name.startswith("mutated-") or not containers:
            return body
        for container in containers:
            container["imagePullPolicy"] = "Always"
        return json.dumps(obj).encode()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = self._mutated(request, await request.read())
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


def test_a_field_a_mutating_webhook_rewrites_is_not_fought_on_every_tick(cluster, policed):
    """The webhook sets imagePullPolicy: Always where the pool says IfNotPresent. Repairing it is tried once; the
    stored object comes back rewritten, so the operator leaves it (before: a PATCH of every Deployment every tick,
    forever)."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "mutated"}, "spec": {}}))
    wait_until(lambda: cluster.kubectl.json("get", POOL, "mutated").get("status", {}).get("observedGeneration") == 1,
               what="generation 1 applied")
    time.sleep(1.5)  # the first ticks: one repair each, answered with the rewritten object
    cluster.clear_writes()
    time.sleep(2.0)
    patches = [w for w in cluster.writes() if w.get("resource") == "deployments"]
    assert patches == [], f"{len(patches)} writes in 2 s"
    (container,) = cluster.kubectl.json("get", "deployment", "mutated-decode")["spec"]["template"]["spec"]["containers"]
    assert container["imagePullPolicy"] == "Always"
    cluster.kubectl("patch", POOL, "mutated", "--type=merge", "-p", '{"spec": {"engine": {"maxNumSeqs": 4}}}')
    wait_until(lambda: "4" in cluster.kubectl.json("get", "deployment", "mutated-decode")["spec"]["template"]["spec"]
               ["containers"][0]["args"], timeout=10, what="a spec change still applied")
    cluster.kubectl("delete", POOL, "mutated", "--timeout=20s")
