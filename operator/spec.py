"""A pool's body → a typed, validated ``Pool``: the edge where handlers turn YAML into dataclasses.

The API server already enforces the CRD schema; ``SpecError`` is what the schema cannot say (two fields that
exclude each other, a model path outside its volume, a GPU device without a GPU). The handlers report it as a
``Degraded`` condition and an Event, and do not retry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdpool import config
from pdpool.operator import crd
from pdpool.operator.quantity import quantity

NODE_ROLES = ("prefill", "decode")
NODE_HTTP_PORT = 8000
GPU = "nvidia.com/gpu"


class SpecError(ValueError):
    """The spec passed the schema but cannot be deployed."""


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str | None  # None: the whole Secret (envFrom)


@dataclass
class RoleSpec:
    replicas: int | None
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    env: list = field(default_factory=list)


@dataclass
class Pool:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict                      # with defaults applied
    node: config.NodeConfig         # the settings every node shares (role, port, redis set per Deployment)
    router: config.RouterCommandConfig
    roles: dict[str, RoleSpec]      # prefill, decode, router

    @property
    def image(self) -> str:
        return self.spec["image"]

    @property
    def image_pull_secrets(self) -> list[dict]:
        """For every pod of the pool; empty: the pods carry no such field."""
        return [{"name": ref["name"]} for ref in self.spec.get("imagePullSecrets") or []]

    @property
    def managed_redis(self) -> bool:
        return not self.spec["redis"].get("url")

    @property
    def redis_password(self) -> SecretRef | None:
        """None: an external Redis without a password (redis.url alone)."""
        if self.managed_redis:
            return SecretRef(f"{self.name}-redis", "password")
        ref = self.spec["redis"].get("passwordSecretRef")
        return SecretRef(ref["name"], ref.get("key", "password")) if ref else None

    @property
    def api_key(self) -> SecretRef | None:
        ref = self.spec["router"].get("apiKeySecretRef")
        return SecretRef(ref["name"], ref.get("key", "api-key")) if ref else None

    @property
    def object_store_credentials(self) -> SecretRef | None:
        """The Secret whose keys the model download's init container reads (envFrom), if any."""
        ref = ((self.spec["model"].get("source") or {}).get("objectStore") or {}).get("credentialsSecretRef")
        return SecretRef(ref["name"], None) if ref else None

    @property
    def redis_url(self) -> str:
        return self.spec["redis"].get("url") or f"redis://{self.name}-redis.{self.namespace}.svc:6379/0"

    @property
    def kubernetes_discovery(self) -> bool:
        """The router finds nodes through EndpointSlices: it then gets a token and a read-only Role."""
        return self.spec["router"]["discovery"] == "kubernetes"

    @property
    def termination_grace_seconds(self) -> int:
        """Longer than a KV lease, so a draining prefill node outlives every lease it granted."""
        return math.ceil(self.node.disagg.kv_lease_seconds) + 30


def _get(tree: dict, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _settings(spec: dict, cfg_cls: type):
    """Build one process's config from the spec's ``crd`` paths (defaults from the schema are already in)."""
    flat = {}
    for _, f in config.all_options(cfg_cls):
        path = f.metadata.get("crd")
        if path and _get(spec, path) is not None:
            flat[f.name] = _get(spec, path)
    try:
        return config.build(cfg_cls, **flat)
    except config.ConfigError as exc:
        raise SpecError(str(exc)) from None


def _role(spec: dict, role: str) -> RoleSpec:
    r = spec.get(role) or {}
    return RoleSpec(replicas=r.get("replicas"), resources=r.get("resources") or {},
                    node_selector=r.get("nodeSelector") or {}, tolerations=r.get("tolerations") or [],
                    env=r.get("env") or [])


def _check(pool: Pool) -> None:
    spec = pool.spec
    source = spec["model"].get("source") or {}
    if len(source) > 1:
        raise SpecError(f"model.source: set one of pvc, hostPath, objectStore, image (got {sorted(source)})")
    if source:
        mount = spec["model"]["mountPath"].rstrip("/")
        if not spec["model"]["name"].startswith(mount + "/"):
            raise SpecError(f"model.name {spec['model']['name']!r} must be a path under model.mountPath "
                            f"{mount!r} when model.source is set")
    if pool.managed_redis and spec["redis"].get("passwordSecretRef"):
        raise SpecError("redis.passwordSecretRef needs redis.url; a managed Redis generates its own password")
    if pool.node.device.device == "cuda":
        for role in NODE_ROLES:
            limits = pool.roles[role].resources.get("limits") or {}
            if not quantity(limits.get(GPU)):   # absent, 0 or "0": no GPU ("0" is a true string)
                raise SpecError(f"engine.device is cuda but {role}.resources.limits has no {GPU}")


def merge_defaults(spec: dict, defaults: dict) -> dict:
    """``defaults`` (the operator's --pool-defaults, a partial spec) under ``spec``: the pool's own values win;
    mappings merge key by key, anything else (lists included) is taken whole from the pool when it sets it."""
    out = dict(defaults)
    for k, v in spec.items():
        out[k] = merge_defaults(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_pool(body: dict, defaults: dict | None = None) -> Pool:
    """``defaults``: a partial spec the cluster's operator applies under every pool (RDMA, UCX, placement)."""
    meta = body["metadata"]
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec = merge_defaults(dict(body.get("spec") or {}), defaults or {})
    spec = crd.apply_defaults(spec, root)
    pool = Pool(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", ""),
                generation=int(meta.get("generation", 1)), spec=spec, node=_settings(spec, config.NodeConfig),
                router=_settings(spec, config.RouterCommandConfig),
                roles={r: _role(spec, r) for r in (*NODE_ROLES, "router")})
    _check(pool)
    return pool
