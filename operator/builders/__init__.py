"""Pure builders: a ``Pool`` → the desired child objects, each with owner reference, labels and spec hash."""

from __future__ import annotations

import secrets
from typing import Callable

from pdpool.operator.builders.common import metadata, with_hash
from pdpool.operator.builders.network import nodes_policy, redis_policy
from pdpool.operator.builders.nodes import node_deployment, node_service
from pdpool.operator.builders.redis import generated_secret, redis_deployment, redis_service
from pdpool.operator.builders.router import (endpoint, router_account_name, router_deployment, router_rbac,
                                             router_service)
from pdpool.operator.spec import NODE_ROLES, Pool

__all__ = ["render", "prunable", "config_map", "endpoint", "new_token"]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def config_map(pool: Pool) -> dict:
    """Environment shared by every pdpool container (UCX reads its settings from the environment)."""
    data = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    disagg = pool.node.disagg
    if disagg.ucx_tls:
        data["UCX_TLS"] = disagg.ucx_tls
    if disagg.ucx_net_devices:
        data["UCX_NET_DEVICES"] = disagg.ucx_net_devices
    return with_hash({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": metadata(pool, f"{pool.name}-config", "config"), "data": data})


def prunable(pool: Pool) -> list[tuple[str, str, str]]:
    """(kind, namespace, name) of every child that only some specs have, in deletion order: the managed Redis
    (redis.url unset) and the router's RBAC (router.discovery: kubernetes)."""
    redis, router = f"{pool.name}-redis", router_account_name(pool)
    return [(kind, pool.namespace, name) for kind, name in (
        ("Deployment", redis), ("Service", redis), ("NetworkPolicy", redis), ("Secret", redis),
        ("RoleBinding", router), ("Role", router), ("ServiceAccount", router))]


def render(pool: Pool, token: Callable[[], str] = new_token) -> list[dict]:
    """Every child, in creation order (what a pod references exists before the pod)."""
    objs = [generated_secret(pool, f"{pool.name}-internal", "token", "internal", token())]
    if pool.managed_redis:
        objs += [generated_secret(pool, f"{pool.name}-redis", "password", "redis", token()),
                 redis_service(pool), redis_deployment(pool), redis_policy(pool)]
    objs += [config_map(pool), nodes_policy(pool)]
    for role in NODE_ROLES:
        objs += [node_service(pool, role), node_deployment(pool, role)]
    objs += [router_service(pool), *router_rbac(pool), router_deployment(pool)]
    return objs
