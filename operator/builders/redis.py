"""The managed Redis (when redis.url is unset) and the pool's generated Secrets.

Generated Secrets are created once and never rewritten: ``reconcile`` treats every Secret as create-only, so a
password survives operator restarts and spec changes. ``token`` is injected so that the builders stay pure.
"""

from __future__ import annotations

import base64

from pdpool.operator.builders.common import labels, metadata, pull_secrets, selector_labels, with_hash
from pdpool.operator.spec import Pool

REDIS_PORT = 6379


def generated_secret(pool: Pool, name: str, key: str, component: str, token: str) -> dict:
    return with_hash({"apiVersion": "v1", "kind": "Secret", "metadata": metadata(pool, name, component),
                      "type": "Opaque", "data": {key: base64.b64encode(token.encode()).decode()}})


def redis_deployment(pool: Pool) -> dict:
    ref = pool.redis_password
    container = {
        "name": "redis",
        "image": pool.spec["redis"]["image"],
        # a cache of block ownership: nothing to persist; the password stays out of argv
        "command": ["sh", "-c", 'exec redis-server --requirepass "$REDIS_PASSWORD" --save "" --appendonly no'],
        "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
    }
    return with_hash({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": metadata(pool, f"{pool.name}-redis", "redis", app="redis"),
                      "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                               "selector": {"matchLabels": selector_labels(pool, "redis")},
                               "template": {"metadata": {"labels": labels(pool, "redis", "redis")}, "spec": {
                                   "enableServiceLinks": False, "automountServiceAccountToken": False,
                                   "containers": [container], **pull_secrets(pool)}}}})


def redis_service(pool: Pool) -> dict:
    return with_hash({"apiVersion": "v1", "kind": "Service",
                      "metadata": metadata(pool, f"{pool.name}-redis", "redis", app="redis"),
                      "spec": {"selector": selector_labels(pool, "redis"),
                               "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis",
                                          "protocol": "TCP"}]}})
