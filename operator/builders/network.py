"""NetworkPolicies: the router alone reaches the nodes' HTTP port (OpenAI and internal routes); only the pool's
nodes reach each other (NIXL metadata port, UCX data, the lease routes); Redis admits only the pool's own pods.

Node to node traffic is allowed on every port, not just the NIXL port: UCX's TCP transport moves KV over
ephemeral ports (RDMA bypasses the kernel's IP stack, so a NetworkPolicy does not see it at all). Decode nodes
call prefill nodes' ``/internal/kv/*`` routes over HTTP. The router's Service stays open to clients;
``networkPolicy.scrapeFrom`` adds peers (Prometheus) allowed to the nodes' HTTP port for ``/metrics``.
"""

from __future__ import annotations

from pdpool.operator.builders.common import metadata, pool_selector, selector_labels, with_hash
from pdpool.operator.builders.nodes import nodes_selector
from pdpool.operator.builders.redis import REDIS_PORT
from pdpool.operator.spec import NODE_HTTP_PORT, Pool


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _policy(pool: Pool, name: str, component: str, pod_selector: dict, ingress: list[dict]) -> dict:
    return with_hash({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                      "metadata": metadata(pool, name, component),
                      "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress}})


def nodes_policy(pool: Pool) -> dict:
    router = {"podSelector": {"matchLabels": selector_labels(pool, "router")}}
    ingress = [{"from": [router], "ports": _tcp(NODE_HTTP_PORT)},
               {"from": [{"podSelector": nodes_selector(pool)}]}]
    scrapers = (pool.spec.get("networkPolicy") or {}).get("scrapeFrom") or []
    if scrapers:
        ingress.append({"from": list(scrapers), "ports": _tcp(NODE_HTTP_PORT)})
    return _policy(pool, f"{pool.name}-nodes", "prefill-decode", nodes_selector(pool), ingress)


def redis_policy(pool: Pool) -> dict:
    return _policy(pool, f"{pool.name}-redis", "redis", {"matchLabels": selector_labels(pool, "redis")},
                   [{"from": [{"podSelector": {"matchLabels": pool_selector(pool)}}], "ports": _tcp(REDIS_PORT)}])
