"""A small async Kubernetes REST client: the few verbs the operator and the Lease elector need.

It authenticates with the ``kopf.ConnectionInfo`` that kopf itself uses (``login``), so one set of credentials
serves kopf's watches and the operator's writes to children.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf

KINDS = {
    "Deployment": ("apis/apps/v1", "deployments"),
    "Service": ("api/v1", "services"),
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Lease": ("apis/coordination.k8s.io/v1", "leases"),
    "InferencePool": ("apis/pdpool.io/v1alpha1", "inferencepools"),
}
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


def login() -> kopf.ConnectionInfo:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig")
    return info


def _as_file(data: str | bytes | None, path: Any) -> str | None:
    if path:
        return str(path)
    if not data:
        return None
    raw = data if isinstance(data, bytes) else data.encode()
    try:
        raw = base64.b64decode(raw, validate=True)
    except ValueError:
        pass
    f = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")
    f.write(raw)
    f.close()
    return f.name


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=_as_file(info.ca_data, info.ca_path))
    cert = _as_file(info.certificate_data, info.certificate_path)
    if cert:
        ctx.load_cert_chain(cert, _as_file(info.private_key_data, info.private_key_path))
    return ctx


def path_of(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    out = f"/{prefix}/namespaces/{namespace}/{plural}" if namespace else f"/{prefix}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


class NotLeader(ApiError):
    """The process no longer holds the Lease: it must not touch the cluster."""

    def __init__(self):
        super().__init__(503, "this operator is not the leader")


class Kube:
    def __init__(self, info: kopf.ConnectionInfo, timeout: float = 10.0, user_agent: str = "pdpool-operator"):
        self.server = info.server.rstrip("/")
        self.headers = {"Accept": "application/json", "User-Agent": user_agent}
        self.fence = None  # set by the leader elector: a callable, False once leadership may be lost
        if info.token:
            self.headers["Authorization"] = f"Bearer {info.token}"
        self.auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        self.ssl = _ssl_context(info)
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                       fenced: bool = True):
        if fenced and self.fence is not None and not self.fence():
            raise NotLeader()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers, auth=self.auth, timeout=self.timeout)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session.request(method, self.server + path, data=data, headers=headers,
                                         ssl=self.ssl) as resp:
            text = await resp.text()
            payload = json.loads(text) if text and text.lstrip().startswith("{") else text
            if resp.status >= 400:
                raise ApiError(resp.status, payload)
            return payload

    async def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return await self._request("GET", path_of(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: dict) -> dict:
        return await self._request("POST", path_of(obj["kind"], obj["metadata"].get("namespace")), obj)

    async def replace(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return await self._request("PUT", path_of(obj["kind"], meta.get("namespace"), meta["name"]), obj)

    async def merge_patch(self, kind: str, namespace: str | None, name: str, patch: dict,
                          subresource: str | None = None) -> dict:
        return await self._request("PATCH", path_of(kind, namespace, name, subresource), patch, MERGE_PATCH)

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """False when it was already gone. Background propagation: the API server's garbage collector removes
        what the object owns (a Deployment's ReplicaSets and pods)."""
        try:
            await self._request("DELETE", path_of(kind, namespace, name), {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
