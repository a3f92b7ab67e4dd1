"""Kubernetes discovery (``--kubernetes``): EndpointSlices of the pool's node Services, against the in-memory API
emulator (tests/k8s_emulator). The emulator runs no controllers, so the tests write the EndpointSlices the
endpoint controller would; the discovered addresses are stub nodes on loopback addresses that answer the
router's probes (``/health/ready``, ``/v1/models``, ``/metrics``)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k8s_emulator import Emulator  # noqa: E402
from k8s_emulator.resources import ResourceType  # noqa: E402
from k8s_fixtures import k8s  # noqa: E402,F401
from k8s_tools import kubectl_path, write_kubeconfig  # noqa: E402

from pdpool.node_process import free_port, http_get  # noqa: E402
from pdpool.router.discovery_k8s import (KubeConfigError, KubeConnection, KubernetesDiscovery,  # noqa: E402
                                         connect, from_kubeconfig, slice_endpoints)
from pdpool.router.endpoints import Pool  # noqa: E402

NS, POOL = "serving", "demo"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


# ---- builders --------------------------------------------------------------------------------------------

def serve_endpointslices(emulator: Emulator) -> None:
    """The emulator's built-ins lack discovery.k8s.io/v1 EndpointSlice; served here the way a CRD is added
    (built-in schema validation still applies: the kind is in the published schemas)."""
    rt = ResourceType("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
    emulator.registry.replace_crd(rt.group, rt.plural, [rt])
    reply = emulator.client().post("/api/v1/namespaces", {"metadata": {"name": NS}})
    assert reply.status == 201, reply.body


def make_slice(name: str, role: str, port: int, endpoints: list[dict], pool: str = POOL,
               role_label: bool = True) -> dict:
    """What the endpoint controller writes for the operator's ``<pool>-<role>`` Service (labels copied)."""
    labels = {"kubernetes.io/service-name": f"{pool}-{role}",
              "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
              "app.kubernetes.io/instance": pool, "app.kubernetes.io/component": role}
    if role_label:
        labels["llm-d.ai/role"] = role
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"},
                                             {"name": "nixl", "port": 5600, "protocol": "TCP"}],
            "endpoints": endpoints}


def make_endpoint(address: str, pod: str, ready: bool | None = True, terminating: bool = False) -> dict:
    conditions = {"terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {"addresses": [address], "conditions": conditions,
            "targetRef": {"kind": "Pod", "namespace": NS, "name": pod}}


class StubNode:
    """Answers the router's probes as a ready pdpool node would, on one loopback address."""

    def __init__(self, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                bodies = {"/health/ready": (b'{"status": "ready"}', "application/json"),
                          "/v1/models": (json.dumps({"object": "list", "data": [
                              {"id": "demo", "object": "model", "owned_by": "pdpool", "max_model_len": 2048}]}
                          ).encode(), "application/json"),
                          "/metrics": (b"vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n"
                                       b"vllm:kv_cache_usage_perc 0.25\n", "text/plain")}
                body, ctype = bodies.get(self.path, (b"{}", "application/json"))
                self.send_response(200 if self.path in bodies else 404)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    """Stub nodes at 127.0.0.2..5 on one port (a slice's endpoints share its port)."""
    for _ in range(5):
        port, nodes = free_port(), []
        try:
            nodes = [StubNode(f"127.0.0.{i}", port) for i in range(2, 6)]
        except OSError:
            for n in nodes:
                n.close()
            continue
        yield port
        for n in nodes:
            n.close()
        return
    pytest.fail("no free port for the stub nodes")


def until(predicate, timeout: float = 10.0):
    """Async wait for ``predicate()``."""
    async def wait():
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)
    return wait()


def view(pool: Pool) -> dict[str, tuple[str, str, bool]]:
    return {e.node_id: (e.role, e.url, pool.usable(e)) for e in pool.endpoints.values()}


# ---- pure parts ------------------------------------------------------------------------------------------

def test_slice_endpoints_keep_ready_endpoints_on_the_http_port():
    obj = make_slice("demo-decode-a", "decode", 8000, [
        make_endpoint("10.0.0.1", "demo-decode-0"),
        make_endpoint("10.0.0.2", "demo-decode-1", ready=None),        # unset: ready (the API's rule)
        make_endpoint("10.0.0.3", "demo-decode-2", ready=False),
        make_endpoint("10.0.0.4", "demo-decode-3", ready=True, terminating=True),
        {"addresses": ["10.0.0.5"], "conditions": {"ready": True}}])   # no targetRef: the URL is the id
    eps = slice_endpoints(obj, POOL)
    assert [(e.node_id, e.url, e.role, e.source) for e in eps] == [
        ("demo-decode-0:8000", "http://10.0.0.1:8000", "decode", "kubernetes"),
        ("demo-decode-1:8000", "http://10.0.0.2:8000", "decode", "kubernetes"),
        ("http://10.0.0.5:8000", "http://10.0.0.5:8000", "decode", "kubernetes")]


def test_slice_role_from_the_service_name_ipv6_and_no_http_port():
    obj = make_slice("demo-prefill-a", "prefill", 8000, [make_endpoint("fd00::1", "demo-prefill-0")],
                     role_label=False)
    obj["addressType"] = "IPv6"
    assert [(e.url, e.role) for e in slice_endpoints(obj, POOL)] == [("http://[fd00::1]:8000", "prefill")]
    obj["ports"] = [{"name": "metrics", "port": 9000}]
    assert slice_endpoints(obj, POOL) == []
    router_slice = make_slice("demo-x", "router", 8000, [make_endpoint("10.0.0.9", "demo-router-0")])
    assert slice_endpoints(router_slice, POOL) == []


def test_kubeconfig_token_and_insecure_https(tmp_path):
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://api.example:6443/",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "abc"}}]}))
    conn = from_kubeconfig(path)
    assert conn.server == "https://api.example:6443" and conn.headers() == {"Authorization": "Bearer abc"}
    assert conn.ssl.verify_mode == 0 and not conn.ssl.check_hostname
    plain = from_kubeconfig(write_kubeconfig(tmp_path / "plain", "http://127.0.0.1:1"))
    assert plain.ssl is False and plain.headers() == {}


def test_kubeconfig_exec_plugins_and_missing_files_are_refused(tmp_path):
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://x"}}],
        "users": [{"name": "u", "user": {"exec": {"command": "aws"}}}]}))
    with pytest.raises(KubeConfigError, match="exec"):
        from_kubeconfig(path)
    with pytest.raises(KubeConfigError, match="nope"):
        connect(None, environ={"KUBECONFIG": str(tmp_path / "nope")})


def test_in_cluster_service_account_token_is_reread(tmp_path):
    (tmp_path / "token").write_text("one\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    conn = connect(None, environ=env, service_account=tmp_path)
    assert conn.server == "https://10.96.0.1:443" and conn.headers() == {"Authorization": "Bearer one"}
    (tmp_path / "token").write_text("two\n")                     # kubelet rotated it
    assert conn.headers() == {"Authorization": "Bearer two"}
    assert connect("http://127.0.0.1:9", environ=env, service_account=tmp_path).server == "http://127.0.0.1:9"
    assert connect("http://127.0.0.1:9", environ={}, service_account=tmp_path).headers() == {}


def test_the_kubernetes_discovery_imports_neither_torch_nor_kopf():
    code = ("import sys; from pdpool.router import main, app, discovery_k8s; "
            "bad = {'torch', 'kopf', 'kubernetes'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- against the emulator ------------------------------------------------------------------------------

async def run_discovery(url: str, body, period: float = 30.0, resource_version: str | None = None,
                        conn: KubeConnection | None = None, namespace: str = NS):
    """Runs the real discovery against the emulator at ``url`` (or ``conn``) while ``body(pool, k8s_call)`` runs."""
    pool = Pool()
    async with aiohttp.ClientSession() as session:
        d = KubernetesDiscovery(conn or connect(url, environ={}), namespace, POOL, pool, session, period)
        await d.refresh()
        if resource_version is not None:
            d.resource_version = resource_version
        task = asyncio.get_running_loop().create_task(d.run())
        try:
            await body(pool, d)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_discovery_follows_adds_readiness_changes_and_deletes(k8s, stubs):  # noqa: F811
    serve_endpointslices(k8s)
    api = k8s.client()
    port = stubs

    def write(method, path, body=None):
        reply = api.request(method, path, body, content_type="application/merge-patch+json" if method == "PATCH"
                            else "application/json")
        assert reply.status in (200, 201), reply.body

    async def body(pool: Pool, d: KubernetesDiscovery):
        assert view(pool) == {}
        # The probe period is 30 s: every change below reaches the pool through the watch.
        write("POST", SLICES, make_slice("demo-decode-abc", "decode", port, [
            make_endpoint("127.0.0.2", "demo-decode-0"), make_endpoint("127.0.0.3", "demo-decode-1")]))
        write("POST", SLICES, make_slice("demo-prefill-abc", "prefill", port, [
            make_endpoint("127.0.0.4", "demo-prefill-0")]))
        write("POST", SLICES, make_slice("other-decode-abc", "decode", port, [     # another pool's Service
            make_endpoint("127.0.0.5", "other-decode-0")], pool="other"))
        expected = {"demo-decode-0:%d" % port: ("decode", f"http://127.0.0.2:{port}", True),
                    "demo-decode-1:%d" % port: ("decode", f"http://127.0.0.3:{port}", True),
                    "demo-prefill-0:%d" % port: ("prefill", f"http://127.0.0.4:{port}", True)}
        await until(lambda: view(pool) == expected)

        await d.probe()                                            # load and pdpool-ness from the stub
        e = pool.endpoints[f"demo-decode-0:{port}"]
        assert (e.pdpool, e.max_model_len, e.load.num_waiting, e.load.num_running, e.load.kv_usage) == (
            True, 2048, 1, 2, 0.25)

        write("PATCH", f"{SLICES}/demo-decode-abc", {"endpoints": [
            make_endpoint("127.0.0.2", "demo-decode-0", ready=False), make_endpoint("127.0.0.3", "demo-decode-1")]})
        await until(lambda: set(view(pool)) == set(expected) - {f"demo-decode-0:{port}"})
        assert pool.endpoints[f"demo-decode-1:{port}"].pdpool is True     # kept across the event

        write("PATCH", f"{SLICES}/demo-decode-abc", {"endpoints": [
            make_endpoint("127.0.0.2", "demo-decode-0"), make_endpoint("127.0.0.3", "demo-decode-1",
                                                                       terminating=True)]})
        await until(lambda: set(view(pool)) == set(expected) - {f"demo-decode-1:{port}"})

        write("DELETE", f"{SLICES}/demo-prefill-abc")
        await until(lambda: set(view(pool)) == {f"demo-decode-0:{port}"})
        assert pool.decode_candidates()[0].url == f"http://127.0.0.2:{port}"
        assert pool.prefill_candidates() == []

    asyncio.run(run_discovery(k8s.url, body))


def test_an_expired_watch_lists_again():
    """A resourceVersion older than the server's history gets 410 Gone; the discovery lists again."""
    with Emulator(watch_history=2) as emulator:
        serve_endpointslices(emulator)
        api = emulator.client()
        for i in range(4):
            reply = api.post(SLICES, make_slice(f"demo-decode-{i}", "decode", 8000, [
                make_endpoint(f"10.0.0.{i + 1}", f"demo-decode-{i}")]))
            assert reply.status == 201

        async def body(pool: Pool, d: KubernetesDiscovery):
            assert d.resource_version == "1"                      # stale: set below, before the watch
            await until(lambda: d.resource_version not in (None, "1"))
            api.delete(f"{SLICES}/demo-decode-0")
            await until(lambda: sorted(pool.endpoints) == [f"demo-decode-{i}:8000" for i in (1, 2, 3)])

        asyncio.run(run_discovery(emulator.url, body, resource_version="1"))


def test_an_api_server_outage_keeps_the_last_known_nodes_and_recovers():
    emulator = Emulator().start()
    try:
        serve_endpointslices(emulator)
        emulator.client().post(SLICES, make_slice("demo-decode-a", "decode", 8000, [
            make_endpoint("10.0.0.1", "demo-decode-0")]))
        port = emulator.port

        async def body(pool: Pool, d: KubernetesDiscovery):
            nonlocal emulator
            await asyncio.to_thread(emulator.stop)                # the API server goes away; so does the watch
            await asyncio.sleep(1.0)
            assert list(pool.endpoints) == ["demo-decode-0:8000"]
            emulator = await asyncio.to_thread(Emulator(port=port).start)   # back, with new state
            serve_endpointslices(emulator)
            emulator.client().post(SLICES, make_slice("demo-decode-b", "decode", 8000, [
                make_endpoint("10.0.0.2", "demo-decode-1")]))
            await until(lambda: list(pool.endpoints) == ["demo-decode-1:8000"], timeout=20)

        asyncio.run(run_discovery(emulator.url, body))
    finally:
        emulator.stop()


# ---- the real command --------------------------------------------------------------------------------------

def test_cli_refuses_a_kubeconfig_it_cannot_use(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "missing")}
    r = subprocess.run([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--kubernetes"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--kubernetes: kubeconfig" in r.stderr, r.stderr


def test_router_process_routes_to_the_nodes_its_endpointslices_name(k8s, stubs, start_router, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    serve_endpointslices(k8s)
    port = stubs
    api = k8s.client()
    api.post(SLICES, make_slice("demo-decode-a", "decode", port, [make_endpoint("127.0.0.2", "demo-decode-0"),
                                                                  make_endpoint("127.0.0.3", "demo-decode-1")]))
    api.post(SLICES, make_slice("demo-prefill-a", "prefill", port, [make_endpoint("127.0.0.4", "demo-prefill-0")]))
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", k8s.url, NS)))
    router = start_router(["--kubernetes", "--namespace", NS, "--pool", POOL], name="router-k8s")

    def ready_nodes():
        status, body = http_get(router.url + "/health/ready")
        return status, json.loads(body).get("nodes")

    assert ready_nodes() == (200, {f"demo-decode-0:{port}": "decode", f"demo-decode-1:{port}": "decode"})
    m = router.metrics()
    assert m['pdpool_router_nodes{role="decode",usable="true"}'] == 2
    assert m['pdpool_router_nodes{role="prefill",usable="true"}'] == 1

    def wait_for(expected):
        deadline = time.monotonic() + 10
        while (seen := ready_nodes()) != expected:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)

    # Both decode pods turn not ready: the prefill node is what is left (it serves whole requests too).
    api.patch(f"{SLICES}/demo-decode-a", {"endpoints": [make_endpoint("127.0.0.2", "demo-decode-0", ready=False),
                                                         make_endpoint("127.0.0.3", "demo-decode-1", ready=False)]})
    wait_for((200, {f"demo-prefill-0:{port}": "prefill"}))
    api.delete(f"{SLICES}/demo-prefill-a")
    wait_for((503, None))
    api.patch(f"{SLICES}/demo-decode-a", {"endpoints": [make_endpoint("127.0.0.3", "demo-decode-1")]})
    wait_for((200, {f"demo-decode-1:{port}": "decode"}))
    assert f"kubernetes node demo-decode-0:{port} left" in router.log_tail(50000)


def test_a_pod_back_at_a_new_address_is_probed_at_once(k8s, stubs):  # noqa: F811
    """A pod that keeps its name and changes its IP (a StatefulSet pod, or the pod's other-family address in a
    dual-stack slice) is a new endpoint for the same node id: it is probed when the event arrives, as a joining
    node is, not left unroutable until the next periodic probe (30 s here)."""
    serve_endpointslices(k8s)
    api, port = k8s.client(), stubs

    async def body(pool: Pool, d: KubernetesDiscovery):
        node = f"demo-decode-0:{port}"
        api.post(SLICES, make_slice("demo-decode-a", "decode", port, [make_endpoint("127.0.0.2", "demo-decode-0")]))
        await until(lambda: view(pool) == {node: ("decode", f"http://127.0.0.2:{port}", True)})
        api.patch(f"{SLICES}/demo-decode-a", {"endpoints": [make_endpoint("127.0.0.3", "demo-decode-0")]})
        await until(lambda: view(pool) == {node: ("decode", f"http://127.0.0.3:{port}", True)}, timeout=5)

    asyncio.run(run_discovery(k8s.url, body))


def test_a_failing_list_is_logged_once_with_its_reason_and_its_recovery(k8s, caplog):  # noqa: F811
    """The API answers 404 (no EndpointSlice API served yet) to the first refresh and every retry: one warning
    with the API's reason, not a traceback and a warning per retry; then one line when it works again."""
    api = k8s.client()

    async def body(pool: Pool, d: KubernetesDiscovery):
        await asyncio.sleep(2.0)                                  # retries at 0.5, 1.5 s
        serve_endpointslices(k8s)
        api.post(SLICES, make_slice("demo-decode-a", "decode", 8000, [make_endpoint("10.0.0.1", "demo-decode-0")]))
        await until(lambda: list(pool.endpoints) == ["demo-decode-0:8000"], timeout=10)
        await until(lambda: any("works again" in msg for _, msg in discovery_lines(caplog)))   # watch open 1 s

    caplog.set_level(logging.INFO, logger="pdpool.router")
    asyncio.run(run_discovery(k8s.url, body))
    lines = discovery_lines(caplog)
    failed = [(level, msg) for level, msg in lines if "failed" in msg]
    assert len(failed) == 1 and failed[0][0] == "WARNING", lines
    assert f"namespace {NS}" in failed[0][1] and "404" in failed[0][1] and "could not find" in failed[0][1]
    assert not any(r.exc_info for r in caplog.records), "no traceback for an API error"
    assert any(level == "INFO" and "works again" in msg for level, msg in lines), lines


def test_a_pod_without_a_service_account_token_is_told_so(tmp_path):
    """In a pod whose token is not mounted (automountServiceAccountToken: false), the refusal names the missing
    token, not only a kubeconfig that a pod never has."""
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBECONFIG": str(tmp_path / "none")}
    with pytest.raises(KubeConfigError, match=f"no service account token at {tmp_path / 'token'}.*automount"):
        connect(None, environ=env, service_account=tmp_path)


async def run_behind_proxy(k8s_url: str, answer_watch, body) -> None:
    """``run_discovery`` through a proxy in front of the emulator that forwards lists and answers each watch with
    ``answer_watch(request)``: what an API server or a proxy does that the emulator does not (RBAC, say)."""
    async def forward(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            return await answer_watch(request)
        async with aiohttp.ClientSession() as s, s.get(k8s_url + request.path_qs) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await run_discovery(f"http://127.0.0.1:{port}", body)
    finally:
        await runner.cleanup()


def discovery_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if "EndpointSlice" in r.getMessage()]


def test_a_role_without_watch_is_logged_once_while_lists_still_work(k8s, caplog):  # noqa: F811
    """RBAC that grants list but not watch: the API server lets the list through and refuses each watch with 403.
    Discovery keeps the listed nodes, and the refusal is one warning, not a warning and a 'works again' line per
    retry (a list alone is not recovery)."""
    serve_endpointslices(k8s)
    k8s.client().post(SLICES, make_slice("demo-decode-a", "decode", 8000, [make_endpoint("10.0.0.1", "demo-decode-0")]))
    forbidden = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                 "message": 'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:serving:'
                            'demo-router" cannot watch resource "endpointslices" in API group "discovery.k8s.io" '
                            f'in the namespace "{NS}"'}

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(forbidden, status=403)

    async def body(pool: Pool, d: KubernetesDiscovery):
        await asyncio.sleep(4.0)                                  # lists and refused watches at 0, 0.5, 1.5, 3.5 s
        assert list(pool.endpoints) == ["demo-decode-0:8000"]

    caplog.set_level(logging.INFO, logger="pdpool.router")
    asyncio.run(run_behind_proxy(k8s.url, refuse, body))
    lines = discovery_lines(caplog)
    assert len(lines) == 1 and lines[0][0] == "WARNING", lines
    assert "HTTP 403" in lines[0][1] and "cannot watch" in lines[0][1], lines


def test_a_watch_that_ends_at_once_is_retried_with_backoff_not_in_a_loop(k8s, caplog):  # noqa: F811
    """A proxy that does not stream answers each watch 200 with no event and ends it. Re-watching at once spun the
    router's event loop (hundreds of requests a second); such a watch counts as a failure, as client-go's reflector
    counts a watch that lasted under a second with no event, and is logged once."""
    serve_endpointslices(k8s)
    k8s.client().post(SLICES, make_slice("demo-decode-a", "decode", 8000, [make_endpoint("10.0.0.1", "demo-decode-0")]))
    watches = 0

    async def end_at_once(request: web.Request) -> web.Response:
        nonlocal watches
        watches += 1
        return web.Response(body=b"", content_type="application/json")

    async def body(pool: Pool, d: KubernetesDiscovery):
        await asyncio.sleep(3.0)                                  # backoff: watches at about 0, 0.5, 1.5 s
        assert list(pool.endpoints) == ["demo-decode-0:8000"]

    caplog.set_level(logging.INFO, logger="pdpool.router")
    asyncio.run(run_behind_proxy(k8s.url, end_at_once, body))
    assert watches <= 5, watches
    lines = discovery_lines(caplog)
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "no event" in lines[0][1], lines


def test_kubeconfig_inline_tls_material_leaves_no_file_behind(tmp_path, monkeypatch):
    """certificate-authority-data and client-certificate/key-data are written to files only for the SSL context to
    load: none stays behind (the client key was left in /tmp, three files on every start)."""
    # a self-signed certificate and its key, made for this test only (openssl req -x509 -newkey rsa:2048 -nodes
    # -subj /CN=kube -days 36500): committed, so the test runs wherever the suite does, openssl or not
    data = Path(__file__).parent / "data"
    cert, key = ((data / f).read_bytes() for f in ("kube-test-cert.pem", "kube-test-key.pem"))
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://api.example:6443",
                                               "certificate-authority-data": base64.b64encode(cert).decode()}}],
        "users": [{"name": "u", "user": {"client-certificate-data": base64.b64encode(cert).decode(),
                                         "client-key-data": base64.b64encode(key).decode()}}]}))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    conn = from_kubeconfig(path)
    assert isinstance(conn.ssl, ssl.SSLContext) and conn.ssl.cert_store_stats()["x509_ca"] == 1
    assert list(scratch.iterdir()) == []


def test_finding_no_slice_says_where_it_looked_and_the_pods_own_namespace(k8s, tmp_path, caplog):  # noqa: F811
    """A router in a pod of namespace serving, started without --namespace, lists namespace default: the API
    answers an empty list, no error, and the router had no node and said nothing. It now says once where it looked
    and which namespace its pod runs in."""
    serve_endpointslices(k8s)
    k8s.client().post(SLICES, make_slice("demo-decode-a", "decode", 8000, [make_endpoint("10.0.0.1", "demo-decode-0")]))
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text(NS)
    conn = connect(k8s.url, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, service_account=tmp_path)

    async def body(pool: Pool, d: KubernetesDiscovery):
        await d.list()                                            # a relist: not said again
        assert pool.endpoints == {}

    caplog.set_level(logging.INFO, logger="pdpool.router")
    asyncio.run(run_discovery(k8s.url, body, conn=conn, namespace="default"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "pdpool.router"]
    assert len(lines) == 1 and lines[0][0] == "WARNING", lines
    for part in ("namespace default", "demo-prefill", "demo-decode", f"this pod runs in namespace {NS}"):
        assert part in lines[0][1], (part, lines)


# ---- KUBECONFIG with several files ------------------------------------------------------------------------

NAMES = ("a", "b")


@st.composite
def kubeconfig_files(draw) -> list[dict | None]:
    """1-3 kubeconfig files (None: a path in $KUBECONFIG that does not exist), each naming some of the clusters,
    users and contexts a and b, and maybe a current-context; the values say which file they come from."""
    files: list[dict | None] = []
    for i in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 5)) == 0:
            files.append(None)
            continue
        doc: dict = {"apiVersion": "v1", "kind": "Config"}
        names = lambda: draw(st.lists(st.sampled_from(NAMES), unique=True))  # noqa: E731
        doc["clusters"] = [{"name": n, "cluster": {"server": f"https://f{i}-{n}.example:6443"}} for n in names()]
        doc["users"] = [{"name": n, "user": {"token": f"f{i}-{n}"}} for n in names()]
        doc["contexts"] = [{"name": n, "context": {"cluster": draw(st.sampled_from(NAMES)),
                                                   "user": draw(st.sampled_from(NAMES)),
                                                   **({"namespace": f"f{i}-{n}"} if draw(st.booleans()) else {})}}
                           for n in names()]
        current = draw(st.sampled_from((None,) + NAMES))
        if current:
            doc["current-context"] = current
        files.append(doc)
    return files


def write_kubeconfigs(root: Path, files: list[dict | None]) -> str:
    """The files, each in a folder of its own, as a $KUBECONFIG list."""
    paths = []
    for i, doc in enumerate(files):
        path = root / f"f{i}" / "config"
        if doc is not None:
            path.parent.mkdir()
            path.write_text(yaml.safe_dump(doc))
        paths.append(str(path))
    return ":".join(paths)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=kubeconfig_files())
def test_several_kubeconfig_files_merge_as_kubectl_merges_them(files):
    """KUBECONFIG=a:b: the first file to name a cluster, user or context wins, current-context is the first file's
    that sets one, a missing file is skipped. Real kubectl's view of the current context is the oracle."""
    with tempfile.TemporaryDirectory() as root:
        env = {"KUBECONFIG": write_kubeconfigs(Path(root), files)}
        view = subprocess.run([str(kubectl_path()), "config", "view", "--minify", "--raw", "-o", "json"],
                              env={**env, "HOME": root}, capture_output=True, text=True, timeout=30)
        try:
            conn = connect(None, environ=env)
        except KubeConfigError as exc:
            conn, refused = None, str(exc)
        if view.returncode != 0:
            event(f"kubectl: {view.stderr.strip().split(' ')[1]}")
            if "cannot locate user" in view.stderr:    # kubectl refuses a context's missing user; no credentials here
                assert conn is not None and conn.headers() == {}
            else:                                      # no current context, or its cluster is missing
                assert conn is None, (view.stderr, conn)
            return
        want = json.loads(view.stdout)
        assert conn is not None, (refused, want)
        event("merged")
        assert conn.server == want["clusters"][0]["cluster"]["server"].rstrip("/")
        assert conn.headers() == {"Authorization": f"Bearer {want['users'][0]['user']['token']}"}


def test_each_file_of_kubeconfig_resolves_its_own_relative_paths(tmp_path):
    """A user defined in the second file reads its tokenFile beside that file, not beside the first one."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "config").write_text(yaml.safe_dump({"current-context": "c", "contexts": [
        {"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    (tmp_path / "two" / "config").write_text(yaml.safe_dump({
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}]}))
    (tmp_path / "two" / "token").write_text("second\n")
    conn = connect(None, environ={"KUBECONFIG": f"{tmp_path / 'one' / 'config'}:{tmp_path / 'two' / 'config'}"})
    assert conn.server == "http://127.0.0.1:1" and conn.headers() == {"Authorization": "Bearer second"}


def test_discovery_through_a_kubeconfig_split_over_two_files(k8s, tmp_path):  # noqa: F811
    """The context (and current-context) in one file, the emulator's cluster in another: the router lists the
    emulator's EndpointSlices."""
    serve_endpointslices(k8s)
    k8s.client().post(SLICES, make_slice("demo-decode-a", "decode", 8000, [make_endpoint("10.0.0.1", "demo-decode-0")]))
    whole = yaml.safe_load(write_kubeconfig(tmp_path / "whole", k8s.url, NS).read_text())
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_text(yaml.safe_dump({"current-context": whole["current-context"], "contexts": whole["contexts"]}))
    second.write_text(yaml.safe_dump({"clusters": whole["clusters"], "users": whole["users"],
                                      "contexts": [{"name": "emulator", "context": {"cluster": "nowhere"}}]}))
    conn = connect(None, environ={"KUBECONFIG": f"{first}:{second}"})

    async def body(pool: Pool, d: KubernetesDiscovery):
        assert set(pool.endpoints) == {"demo-decode-0:8000"}

    asyncio.run(run_discovery(k8s.url, body, conn=conn))


# ---- the namespace watched without --namespace --------------------------------------------------------------

def test_a_router_without_namespace_watches_its_kubeconfig_contexts(k8s, stubs, start_router, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    """kubectl's default namespace is the current context's: so is the router's, without --namespace (it watched
    namespace default and found no node). The kubeconfig is split over two files, as kubectl merges them."""
    serve_endpointslices(k8s)
    port = stubs
    k8s.client().post(SLICES, make_slice("demo-decode-a", "decode", port, [make_endpoint("127.0.0.2",
                                                                                          "demo-decode-0")]))
    whole = yaml.safe_load(write_kubeconfig(tmp_path / "whole", k8s.url, NS).read_text())
    (tmp_path / "contexts").write_text(yaml.safe_dump({"current-context": whole["current-context"],
                                                       "contexts": whole["contexts"]}))
    (tmp_path / "clusters").write_text(yaml.safe_dump({"clusters": whole["clusters"], "users": whole["users"]}))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'contexts'}:{tmp_path / 'clusters'}")
    router = start_router(["--kubernetes", "--pool", POOL], name="router-k8s-context-namespace")
    status, body = http_get(router.url + "/health/ready")
    assert (status, json.loads(body).get("nodes")) == (200, {f"demo-decode-0:{port}": "decode"})


@pytest.mark.parametrize("given, pod_env, ns_file, context, want", [
    (None, None, "serving", None, "serving"),          # in a pod: the service account's namespace file
    (None, "from-env", "serving", None, "from-env"),   # POD_NAMESPACE (the downward API) first, as client-go
    (None, None, None, None, "default"),               # in a pod without either
    ("mine", "from-env", "serving", None, "mine"),     # --namespace wins
    (None, None, None, "ctx", "ctx"),                  # outside a pod: the kubeconfig context's
    (None, None, None, "", "default"),                 # a context without one
    ("mine", None, None, "ctx", "mine"),
])
def test_the_namespace_watched_by_default(tmp_path, given, pod_env, ns_file, context, want):
    from pdpool.router import settings

    if context is None:                               # in a pod
        (tmp_path / "token").write_text("t")
        if ns_file:
            (tmp_path / "namespace").write_text(ns_file + "\n")
        env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", **({"POD_NAMESPACE": pod_env} if pod_env else {})}
    else:
        env = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "config", "http://127.0.0.1:1", context))}
    conn = connect(None, environ=env, service_account=tmp_path)
    cfg, _ = settings.load(["--kubernetes", "--pool", POOL, *(["--namespace", given] if given else [])], environ={})
    r = cfg.router

    async def build():
        async with aiohttp.ClientSession() as session:
            return KubernetesDiscovery.from_config(r, Pool(), session, conn=conn).namespace

    assert asyncio.run(build()) == want
