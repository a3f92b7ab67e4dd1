"""Prefill and decode: a Deployment and a headless Service per role, running ``pdpool serve --role <role>``."""

from __future__ import annotations

import dataclasses

from pdpool import config
from pdpool.operator.builders.common import labels, metadata, selector_labels, with_hash
from pdpool.operator.spec import NODE_HTTP_PORT, Pool, SecretRef

HEALTH_LIVE, HEALTH_READY = "/health/live", "/health/ready"


def node_config(pool: Pool, role: str) -> config.NodeConfig:
    node = pool.node
    return dataclasses.replace(
        node,
        server=dataclasses.replace(node.server, role=role, port=NODE_HTTP_PORT),
        disagg=dataclasses.replace(node.disagg, redis=pool.redis_url, pool=pool.name, namespace=pool.namespace,
                                   advertise_host="$(POD_IP)"),
    )


def secret_env(name: str, ref: SecretRef) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def common_env(pool: Pool) -> list[dict]:
    """Secrets reach processes as PDPOOL_<NAME> (see pdpool.config), never as flags."""
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        secret_env("PDPOOL_REDIS_PASSWORD", pool.redis_password),
        secret_env("PDPOOL_INTERNAL_TOKEN", SecretRef(f"{pool.name}-internal", "token")),
    ]
    if pool.api_key:
        env.append(secret_env("PDPOOL_API_KEY", pool.api_key))
    return env


def http_probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


def model_volume(pool: Pool) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for model.source; none for 'demo' or a path baked into the image."""
    source = pool.spec["model"].get("source") or {}
    mount = pool.spec["model"]["mountPath"]
    if "pvc" in source:
        pvc = source["pvc"]
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"],
                                                             "readOnly": pvc.get("readOnly", True)}}
        vm = {"name": "model", "mountPath": mount, "readOnly": pvc.get("readOnly", True)}
        if pvc.get("subPath"):
            vm["subPath"] = pvc["subPath"]
        return [volume], [vm]
    if "hostPath" in source:
        volume = {"name": "model", "hostPath": {"path": source["hostPath"]["path"], "type": "Directory"}}
        return [volume], [{"name": "model", "mountPath": mount, "readOnly": True}]
    return [], []


def pod_placement(pool: Pool, role: str) -> dict:
    spec = pool.roles[role]
    out: dict = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = list(spec.tolerations)
    return out


def node_deployment(pool: Pool, role: str) -> dict:
    cfg = node_config(pool, role)
    role_spec = pool.roles[role]
    volumes, mounts = model_volume(pool)
    container = {
        "name": "node",
        "image": pool.image,
        "imagePullPolicy": pool.spec["imagePullPolicy"],
        "command": ["pdpool"],
        "args": ["serve", *config.to_argv(cfg)],
        "ports": [{"name": "http", "containerPort": NODE_HTTP_PORT, "protocol": "TCP"},
                  {"name": "nixl", "containerPort": cfg.disagg.nixl_port, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": f"{pool.name}-config"}}],
        "env": common_env(pool) + list(role_spec.env),
        "resources": role_spec.resources,
        # startup covers model load; after it, liveness restarts a wedged process, readiness gates traffic
        "startupProbe": http_probe(HEALTH_LIVE, 5, 120),
        "livenessProbe": http_probe(HEALTH_LIVE, 10, 3),
        "readinessProbe": http_probe(HEALTH_READY, 5, 2),
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-m", "pdpool.operator.drain", "--port", str(NODE_HTTP_PORT),
            "--wait", str(cfg.disagg.kv_lease_seconds)]}}},
    }
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec = {
        "terminationGracePeriodSeconds": pool.termination_grace_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
        **pod_placement(pool, role),
    }
    if volumes:
        pod_spec["volumes"] = volumes
    spec: dict = {
        "selector": {"matchLabels": selector_labels(pool, role)},
        "template": {"metadata": {"labels": labels(pool, role)}, "spec": pod_spec},
    }
    if role_spec.replicas is not None:  # unset: an autoscaler owns replicas, and the operator never writes them
        spec = {"replicas": role_spec.replicas, **spec}
    return with_hash({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": metadata(pool, f"{pool.name}-{role}", role), "spec": spec})


def node_service(pool: Pool, role: str) -> dict:
    """Headless: peers find each other through Redis; the Service gives pods DNS names and a scrape target."""
    return with_hash({"apiVersion": "v1", "kind": "Service", "metadata": metadata(pool, f"{pool.name}-{role}", role),
                      "spec": {"clusterIP": "None", "selector": selector_labels(pool, role),
                               "ports": [{"name": "http", "port": NODE_HTTP_PORT, "targetPort": "http",
                                          "protocol": "TCP"}]}})
