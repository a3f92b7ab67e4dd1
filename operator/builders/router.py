"""The router: a Deployment running ``pdpool router`` and the pool's Service (its endpoint)."""

from __future__ import annotations

import dataclasses

from pdpool import config
from pdpool.operator.builders.common import labels, metadata, pull_secrets, selector_labels, with_hash
from pdpool.operator.builders.nodes import (HEALTH_LIVE, HEALTH_READY, common_env, http_probe, model_volume,
                                            pod_placement)
from pdpool.operator.spec import Pool


# The router's read-only access, granted only with router.discovery: kubernetes (router/discovery_k8s.py).
DISCOVERY_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]


def router_config(pool: Pool) -> config.RouterCommandConfig:
    r = pool.router.router
    return dataclasses.replace(pool.router, router=dataclasses.replace(
        r, redis=pool.redis_url, pool=pool.name, namespace=pool.namespace, kubernetes=pool.kubernetes_discovery))


def router_account_name(pool: Pool) -> str:
    return f"{pool.name}-router"


def router_rbac(pool: Pool) -> list[dict]:
    """ServiceAccount, Role (EndpointSlices, read-only) and RoleBinding of a router that discovers nodes through
    the Kubernetes API; nothing when it uses Redis (its pods then get no token at all)."""
    if not pool.kubernetes_discovery:
        return []
    name = router_account_name(pool)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(pool, name, "router"),
               "automountServiceAccountToken": False}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata(pool, name, "router"),
            "rules": DISCOVERY_RULES}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": metadata(pool, name, "router"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]}
    return [with_hash(account), with_hash(role), with_hash(binding)]


def router_deployment(pool: Pool) -> dict:
    """The router tokenizes as the engines do, so it mounts the model folder (read-only) as the nodes do."""
    cfg = router_config(pool)
    model = model_volume(pool, weights=False)
    volumes, mounts = model.volumes, model.mounts
    container = {
        "name": "router",
        "image": pool.image,
        "imagePullPolicy": pool.spec["imagePullPolicy"],
        "command": ["pdpool"],
        "args": ["router", *config.to_argv(cfg, config.RouterCommandConfig)],
        "ports": [{"name": "http", "containerPort": cfg.router.port, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": f"{pool.name}-config"}}],
        "env": common_env(pool) + list(pool.roles["router"].env),
        "resources": pool.roles["router"].resources,
        "livenessProbe": http_probe(HEALTH_LIVE, 10, 3),
        "readinessProbe": http_probe(HEALTH_READY, 5, 2),
    }
    if mounts:
        container["volumeMounts"] = [dict(m, readOnly=True) for m in mounts]
    pod_spec = {"enableServiceLinks": False, "automountServiceAccountToken": pool.kubernetes_discovery,
                "containers": [container], **pull_secrets(pool), **pod_placement(pool, "router")}
    if pool.kubernetes_discovery:
        pod_spec["serviceAccountName"] = router_account_name(pool)
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    if volumes:
        pod_spec["volumes"] = volumes
    spec: dict = {
        "selector": {"matchLabels": selector_labels(pool, "router")},
        "template": {"metadata": {"labels": labels(pool, "router")}, "spec": pod_spec},
    }
    if pool.roles["router"].replicas is not None:
        spec = {"replicas": pool.roles["router"].replicas, **spec}
    return with_hash({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": metadata(pool, f"{pool.name}-router", "router"), "spec": spec})


def router_service(pool: Pool) -> dict:
    svc = pool.spec["router"]["service"]
    return with_hash({"apiVersion": "v1", "kind": "Service", "metadata": metadata(pool, pool.name, "router"),
                      "spec": {"type": svc["type"], "selector": selector_labels(pool, "router"),
                               "ports": [{"name": "http", "port": svc["port"], "targetPort": "http",
                                          "protocol": "TCP"}]}})


def endpoint(pool: Pool) -> str:
    return f"http://{pool.name}.{pool.namespace}.svc:{pool.spec['router']['service']['port']}"
