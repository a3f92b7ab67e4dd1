"""Nodes from the EndpointSlices of the pool's node Services (``--kubernetes``).

The operator renders one headless Service per role, ``<pool>-prefill`` and ``<pool>-decode``, labelled
``llm-d.ai/role``; the endpoint controller keeps an EndpointSlice per Service, labelled
``kubernetes.io/service-name`` and carrying the Service's labels. The router lists those slices, then watches
them (resuming from the last resourceVersion, listing again on 410 Gone or any error, with backoff after an error
or a watch ended at once; a failure is logged once per reason, and again when it is over), and feeds the ready
endpoints' ``http`` ports to the pool. A pod that turns not ready, starts terminating or goes away drops out
on the watch event, not on the next probe. Ready endpoints are probed like static nodes (``/health/ready``,
``/v1/models``, ``/metrics``) for load and for whether they speak pdpool, every ``--discovery-seconds``; a node
that joins is routed to once its first probe answers.

With ``--redis`` too, Redis serves the prefix index only: an endpoint's id is ``<pod name>:<port>``, the id a
pdpool node gives itself by default (a pod's hostname is its name), so the index's entries name the same nodes.

Credentials (no kopf, no kubernetes client package): in a pod the service account (token re-read on every
request, since kubelet rotates it); elsewhere the current context of ``$KUBECONFIG`` (several files merged as
kubectl merges them) or ``~/.kube/config`` (token, token file or client certificate; exec plugins are not
supported). ``--kube-api URL`` overrides the server; outside a pod it then talks to that URL without credentials,
never sending a kubeconfig's secrets to another server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from pdpool.router.discovery_static import StaticDiscovery
from pdpool.router.endpoints import Endpoint, Pool
from pdpool.utils import http_url, url_host

logger = logging.getLogger("pdpool.router")

ROLE_LABEL = "llm-d.ai/role"                      # as pdpool.operator.builders.common.ROLE_LABEL
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
NODE_ROLES = ("prefill", "decode")                # the operator's node Services: <pool>-<role>
PORT_NAME = "http"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_SECONDS = 300
SHORT_WATCH_SECONDS = 1.0                          # a watch open this long works (client-go's "very short watch")


class KubeConfigError(ValueError):
    pass


class WatchExpired(Exception):
    """410 Gone: the resourceVersion left the server's history; list again."""


class WatchEndedAtOnce(Exception):
    """The server ended a watch within ``SHORT_WATCH_SECONDS`` with no event (a proxy that does not stream, say):
    a failure, as in client-go's reflector, so that re-watching backs off instead of spinning."""


def failure_reason(exc: Exception) -> str:
    """What a list or watch failure says: the API's Status message, or the client's error."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"HTTP {exc.status}: {exc.message}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (no answer in time)"


async def raise_for_status(resp: aiohttp.ClientResponse) -> None:
    """A non-200 answer as ``ClientResponseError`` carrying the API's Status message (why it refused)."""
    if resp.status == 200:
        return
    text = await resp.text(errors="replace")
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=str(message)[:500])


# ---- credentials ----------------------------------------------------------------------------------------

@dataclass
class KubeConnection:
    server: str
    token: str | None = None
    token_file: str | None = None
    ssl: ssl.SSLContext | bool = False
    own_namespace: str | None = None              # in a pod, the pod's (``pod_namespace``)
    context_namespace: str | None = None          # outside, the kubeconfig's current context's

    @property
    def namespace(self) -> str:
        """The namespace to watch without ``--namespace``: the pod's own, else the kubeconfig context's, else
        default (client-go's and kubectl's default namespace)."""
        return self.own_namespace or self.context_namespace or "default"

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file:
            token = Path(self.token_file).read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def _pem_file(data: str | None, path: str | None, base: Path, written: list[str]) -> str | None:
    """The file to load: ``path`` (relative to the kubeconfig), else ``data`` written to a temporary file, which
    is appended to ``written`` for the caller to remove once loaded."""
    if path:
        return str(base / path)
    if not data:
        return None
    fd, name = tempfile.mkstemp(suffix=".pem", prefix="pdpool-kube-")
    written.append(name)
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data))
    return name


def _ssl(server: str, ca: str | None, cert: str | None, key: str | None, insecure: bool) -> ssl.SSLContext | bool:
    if not server.startswith("https"):
        return False
    ctx = ssl.create_default_context(cafile=ca)
    if insecure:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def _merged_kubeconfig(paths: list[Path]) -> tuple[dict, dict[str, dict[str, tuple[dict, Path]]]]:
    """The files of ``$KUBECONFIG`` merged as kubectl (client-go's loading rules) merges them: the first file to
    name a cluster, context or user wins (the whole entry), the first file that sets current-context wins, and a
    file that does not exist is skipped. Returns (the scalar settings, {"clusters" | "contexts" | "users": {name:
    (entry, the folder of its file, where its relative paths point)}})."""
    top: dict = {}
    named: dict[str, dict[str, tuple[dict, Path]]] = {"clusters": {}, "contexts": {}, "users": {}}
    found = False
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            continue
        found = True
        if not isinstance(doc, dict):
            raise TypeError(f"{path} is not a mapping")
        for key, value in doc.items():
            if key in named:
                for item in value or []:
                    named[key].setdefault(item["name"], (item.get(key[:-1]) or {}, path.parent))
            elif value and key not in top:
                top[key] = value
    if not found:
        raise FileNotFoundError(f"no such file: {os.pathsep.join(map(str, paths))}")
    return top, named


def from_kubeconfig(path: Path | list[Path]) -> KubeConnection:
    """The current context of one kubeconfig, or of several merged (``_merged_kubeconfig``)."""
    paths = [path] if isinstance(path, Path) else path
    label = os.pathsep.join(map(str, paths))
    try:
        top, named = _merged_kubeconfig(paths)
        ctx_name = top["current-context"]
        context, _ = named["contexts"][ctx_name]
        context_namespace = context.get("namespace") or None
        cluster, cluster_base = named["clusters"][context["cluster"]]
        user, user_base = named["users"].get(context.get("user"), ({}, cluster_base))
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:
        raise KubeConfigError(f"kubeconfig {label}: {type(exc).__name__}: {exc}") from None
    if "exec" in user or "auth-provider" in user:
        raise KubeConfigError(f"kubeconfig {label}: exec and auth-provider credentials are not supported; "
                              "use a token or a client certificate")
    server = cluster["server"].rstrip("/")
    written: list[str] = []                       # inline certificates and key: loaded, then removed
    try:
        context = _ssl(server, _pem_file(cluster.get("certificate-authority-data"),
                                         cluster.get("certificate-authority"), cluster_base, written),
                       _pem_file(user.get("client-certificate-data"), user.get("client-certificate"), user_base,
                                 written),
                       _pem_file(user.get("client-key-data"), user.get("client-key"), user_base, written),
                       bool(cluster.get("insecure-skip-tls-verify")))
    except (ValueError, OSError) as exc:          # bad base64, unreadable or invalid PEM (ssl.SSLError)
        raise KubeConfigError(f"kubeconfig {label}: TLS material: {exc}") from None
    finally:
        for name in written:
            os.unlink(name)
    token_file = str(user_base / user["tokenFile"]) if user.get("tokenFile") else None
    return KubeConnection(server, token=user.get("token"), token_file=token_file, ssl=context,
                          context_namespace=context_namespace)


def pod_namespace(environ, service_account: Path = SERVICE_ACCOUNT) -> str | None:
    """A pod's own namespace, as client-go's in-cluster config finds it: ``POD_NAMESPACE`` (the downward API),
    else the service account's ``namespace`` file."""
    own = (environ.get("POD_NAMESPACE") or "").strip()
    if not own:
        try:
            own = (service_account / "namespace").read_text().strip()
        except OSError:
            pass
    return own or None


def connect(kube_api: str | None, environ=os.environ, service_account: Path = SERVICE_ACCOUNT) -> KubeConnection:
    """In a pod: the service account (``kube_api`` overrides the server); else ``kube_api`` without credentials,
    else the kubeconfig's current context."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
    own = pod_namespace(environ, service_account) if host else None
    if host and (service_account / "token").exists():
        server = kube_api or f"https://{url_host(host)}:{port}"
        ca = service_account / "ca.crt"
        return KubeConnection(server.rstrip("/"), token_file=str(service_account / "token"),
                              ssl=_ssl(server, str(ca) if ca.exists() else None, None, None, False),
                              own_namespace=own)
    if kube_api:
        return KubeConnection(kube_api.rstrip("/"), ssl=_ssl(kube_api, None, None, None, False), own_namespace=own)
    paths = list(dict.fromkeys(p for p in (environ.get("KUBECONFIG") or "").split(os.pathsep) if p))
    try:
        return from_kubeconfig([Path(p) for p in paths] or Path.home() / ".kube" / "config")
    except KubeConfigError as exc:
        if host:   # in a pod: the token is what is missing, not a kubeconfig
            hint = (f"in a pod (KUBERNETES_SERVICE_HOST is set) with no service account token at "
                    f"{service_account / 'token'} (automountServiceAccountToken: false?), and ")
            raise KubeConfigError(hint + str(exc)) from None
        raise


# ---- EndpointSlices -> endpoints ------------------------------------------------------------------------

def slice_endpoints(obj: dict, pool_name: str) -> list[Endpoint]:
    """The ready, not terminating endpoints of one slice, on its ``http`` port. Role: the slice's role label
    (copied from the Service), else the Service name ``<pool>-<role>``."""
    labels = obj.get("metadata", {}).get("labels") or {}
    role = labels.get(ROLE_LABEL) or labels.get(SERVICE_NAME_LABEL, "").removeprefix(f"{pool_name}-")
    port = next((p.get("port") for p in obj.get("ports") or [] if p.get("name") == PORT_NAME), None)
    if role not in NODE_ROLES or not port:
        return []
    out = []
    for ep in obj.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") or not ep.get("addresses"):
            continue                                   # ready unset means ready (the API's rule)
        url = http_url(ep["addresses"][0], port)
        ref = ep.get("targetRef") or {}
        # A pdpool node's default id is hostname:port, and a pod's hostname is its name: ids match Redis's.
        node_id = f"{ref['name']}:{port}" if ref.get("kind") == "Pod" and ref.get("name") else url
        out.append(Endpoint(node_id=node_id, url=url, role=role, source="kubernetes", ready=False))
    return out


class KubernetesDiscovery:
    def __init__(self, conn: KubeConnection, namespace: str, pool_name: str, pool: Pool,
                 session: aiohttp.ClientSession, period: float) -> None:
        self.conn = conn
        self.namespace = namespace
        self.pool_name = pool_name
        self.pool = pool
        self.period = period
        self.prober = StaticDiscovery({}, pool, session, period)     # its /health/ready, /v1/models, /metrics
        self.selector = f"{SERVICE_NAME_LABEL} in ({','.join(f'{pool_name}-{r}' for r in NODE_ROLES)})"
        self.slices: dict[str, list[Endpoint]] = {}                   # slice name -> its ready endpoints
        self.known: dict[str, Endpoint] = {}                          # node id -> endpoint (probe state kept)
        self.resource_version: str | None = None
        self._api: aiohttp.ClientSession | None = None
        self._probes: set[asyncio.Task] = set()                       # first probes of nodes that just joined
        self._failure: str | None = None            # the failure last logged; the same one again is not
        self._told_empty = False                     # an empty list was logged (until a list finds slices)

    @classmethod
    def from_config(cls, r, pool: Pool, session: aiohttp.ClientSession,
                    conn: KubeConnection | None = None) -> "KubernetesDiscovery":
        """``--namespace`` when given, else the connection's (``KubeConnection.namespace``)."""
        conn = conn or connect(r.kube_api)
        if not r.namespace:
            where = ("the pod's own" if conn.own_namespace else
                     "the kubeconfig context's" if conn.context_namespace else "no other given")
            logger.info("watching EndpointSlices in namespace %s (%s; --namespace sets another)", conn.namespace, where)
        return cls(conn, r.namespace or conn.namespace, r.pool, pool, session, r.discovery_seconds)

    def _url(self, **params) -> str:
        query = urllib.parse.urlencode({"labelSelector": self.selector, **params})
        return self.conn.server + SLICES.format(namespace=self.namespace) + "?" + query

    def _session(self) -> aiohttp.ClientSession:
        if self._api is None or self._api.closed:
            self._api = aiohttp.ClientSession(headers={"Accept": "application/json",
                                                       "User-Agent": "pdpool-router"})
        return self._api

    # ---- the pool's view ------------------------------------------------------------------------------

    def _apply(self, event_type: str, obj: dict) -> None:
        name = obj.get("metadata", {}).get("name", "")
        if event_type == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_endpoints(obj, self.pool_name)

    def _publish(self) -> None:
        current: dict[str, Endpoint] = {}
        for eps in self.slices.values():
            for e in eps:
                kept = self.known.get(e.node_id)
                if kept is not None and (kept.url, kept.role) == (e.url, e.role):
                    e = kept
                current[e.node_id] = e
        for node_id in set(self.known) ^ set(current):
            logger.info("kubernetes node %s %s", node_id, "joined" if node_id in current else "left")
        # New endpoints (a node that joined, or one back at another address) are not ready until probed.
        unprobed = [e for node_id, e in current.items() if self.known.get(node_id) is not e]
        self.known = current
        self.pool.replace("kubernetes", list(current.values()))
        if unprobed:  # routed to once a probe has told whether it is ready and speaks pdpool
            task = asyncio.get_running_loop().create_task(self._probe(unprobed))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, eps: list[Endpoint]) -> None:
        await asyncio.gather(*(self.prober.probe(e) for e in eps))
        self.pool.replace("kubernetes", list(self.known.values()))

    async def probe(self) -> None:
        """Load and pdpool-ness of every ready endpoint; a node that fails its probe is not routed to."""
        await self._probe(list(self.known.values()))

    # ---- list and watch -------------------------------------------------------------------------------

    async def list(self) -> None:
        async with self._session().get(self._url(), headers=self.conn.headers(), ssl=self.conn.ssl,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
            await raise_for_status(resp)
            body = await resp.json(content_type=None)
        self.slices = {}
        for obj in body.get("items") or []:
            self._apply("ADDED", obj)
        self.resource_version = body.get("metadata", {}).get("resourceVersion")
        self._publish()
        if not self.slices and not self._told_empty:
            self._say_empty()
        self._told_empty = not self.slices

    def _say_empty(self) -> None:
        """An empty list is no error to the API, but a router with no node: say where it looked (once)."""
        own = self.conn.own_namespace
        hint = f" (this pod runs in namespace {own})" if own and own != self.namespace else ""
        logger.warning("no EndpointSlice of Service %s-%s in namespace %s: no nodes until one appears; check --pool "
                       "and --namespace%s", self.pool_name, f" or {self.pool_name}-".join(NODE_ROLES),
                       self.namespace, hint)

    async def refresh(self) -> None:
        try:
            await self.list()
        except Exception as exc:  # noqa: BLE001 - logged once here; the watch loop retries
            self._failed(exc)
            return
        await asyncio.gather(*self._probes)

    def _failed(self, exc: Exception) -> None:
        """One warning per reason: a failure that persists (RBAC, a wrong namespace, an API server away) is not
        logged again on every retry."""
        reason = failure_reason(exc)
        if reason != self._failure:
            logger.warning("EndpointSlice list/watch at %s in namespace %s failed: %s; keeping the last known "
                           "nodes (%d), retrying (logged again if the reason changes)", self.conn.server,
                           self.namespace, reason, len(self.known))
        self._failure = reason

    def _recovered(self) -> None:
        if self._failure is not None:
            logger.info("EndpointSlice list/watch in namespace %s works again: %d nodes", self.namespace,
                        len(self.known))
            self._failure = None

    async def watch(self) -> None:
        """One watch request from ``resource_version``; returns when the server ends it. The watch works (a failure
        before it is over) once it has been open ``SHORT_WATCH_SECONDS`` or has brought an event: a list alone may
        work while watch is refused."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_SECONDS),
                  "resourceVersion": self.resource_version or "0"}
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=WATCH_SECONDS + 30)
        started, events = time.monotonic(), 0
        async with self._session().get(self._url(**params), headers=self.conn.headers(), ssl=self.conn.ssl,
                                       timeout=timeout) as resp:
            if resp.status == 410:
                raise WatchExpired()
            await raise_for_status(resp)
            opened = asyncio.get_running_loop().call_later(SHORT_WATCH_SECONDS, self._recovered)
            try:
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self._on_event(json.loads(line))
                            events += 1
            finally:
                opened.cancel()
        if events:
            self._recovered()
        elif time.monotonic() - started < SHORT_WATCH_SECONDS:
            raise WatchEndedAtOnce(f"the API server ended the watch within {SHORT_WATCH_SECONDS:g} s with no event")

    def _on_event(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchExpired()
            raise aiohttp.ClientPayloadError(f"watch error: {obj.get('message')}")
        rv = obj.get("metadata", {}).get("resourceVersion")
        if rv:
            self.resource_version = rv
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._apply(kind, obj)
            self._publish()

    async def _watch_forever(self) -> None:
        backoff = 0.0
        while True:
            try:
                if self.resource_version is None or backoff:
                    await self.list()
                await self.watch()
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except WatchExpired:
                logger.info("EndpointSlice watch expired; listing again")
                self.resource_version = None
            except Exception as exc:  # noqa: BLE001 - discovery must keep going on the last known nodes
                backoff = min(10.0, max(0.5, backoff * 2))
                self._failed(exc)
                await asyncio.sleep(backoff)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.probe()
            except Exception:  # noqa: BLE001
                logger.exception("probing kubernetes nodes failed")

    async def run(self) -> None:
        try:
            await asyncio.gather(self._watch_forever(), self._probe_forever())
        finally:
            for task in list(self._probes):
                task.cancel()
            if self._api is not None:
                await self._api.close()
