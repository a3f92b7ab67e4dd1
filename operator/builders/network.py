"""NetworkPolicies: Redis and the nodes' HTTP and NIXL ports admit only this pool's own pods.

The router's Service stays open to clients; the router reaches nodes because it is one of the pool's pods.
"""

from __future__ import annotations

from pdpool.operator.builders.common import metadata, pool_selector, selector_labels, with_hash
from pdpool.operator.builders.redis import REDIS_PORT
from pdpool.operator.spec import NODE_HTTP_PORT, Pool


def _policy(pool: Pool, name: str, component: str, pod_selector: dict, ports: list[int]) -> dict:
    return with_hash({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                      "metadata": metadata(pool, name, component),
                      "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": [{
                          "from": [{"podSelector": {"matchLabels": pool_selector(pool)}}],
                          "ports": [{"protocol": "TCP", "port": p} for p in ports]}]}})


def nodes_policy(pool: Pool) -> dict:
    selector = {"matchLabels": pool_selector(pool), "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]}
    return _policy(pool, f"{pool.name}-nodes", "prefill-decode", selector,
                   [NODE_HTTP_PORT, pool.node.disagg.nixl_port])


def redis_policy(pool: Pool) -> dict:
    return _policy(pool, f"{pool.name}-redis", "redis", {"matchLabels": selector_labels(pool, "redis")},
                   [REDIS_PORT])
