"""Prefill and decode: a Deployment and a headless Service per role, running ``pdpool serve --role <role>``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdpool import config
from pdpool.operator.builders.common import (labels, metadata, pool_selector, pull_secrets, selector_labels,
                                             with_hash)
from pdpool.operator.spec import NODE_HTTP_PORT, Pool, SecretRef

HEALTH_LIVE, HEALTH_READY = "/health/live", "/health/ready"
STARTUP_PERIOD = 5  # seconds between startup probes; model.loadTimeoutSeconds sets how many may fail


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
    ]
    if pool.redis_password:
        env.append(secret_env("PDPOOL_REDIS_PASSWORD", pool.redis_password))
    env.append(secret_env("PDPOOL_INTERNAL_TOKEN", SecretRef(f"{pool.name}-internal", "token")))
    if pool.api_key:
        env.append(secret_env("PDPOOL_API_KEY", pool.api_key))
    return env


def http_probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


# What the router needs of a model folder: the tokenizer and configs, not the weights.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


@dataclass
class ModelMount:
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)


def download_container(pool: Pool, store: dict, mount: str, weights: bool) -> dict:
    args = ["s3", "sync", "--no-progress", "--only-show-errors"]
    if store.get("endpointUrl"):
        args += ["--endpoint-url", store["endpointUrl"]]
    if not weights:
        for pattern in WEIGHT_FILES:
            args += ["--exclude", pattern]
    container = {"name": "model-download", "image": store["image"], "command": ["aws"],
                 "args": [*args, store["uri"], mount], "env": [{"name": "HOME", "value": "/tmp"}],
                 "volumeMounts": [{"name": "model", "mountPath": mount}],
                 "securityContext": {"allowPrivilegeEscalation": False}}
    if store.get("credentialsSecretRef"):
        container["envFrom"] = [{"secretRef": {"name": store["credentialsSecretRef"]["name"]}}]
    return container


def model_volume(pool: Pool, weights: bool = True) -> ModelMount:
    """Volumes, mounts and init containers for model.source; none for 'demo' or a path baked into the image.
    ``weights=False`` (the router, which only tokenizes) downloads everything but the weight files."""
    source = pool.spec["model"].get("source") or {}
    mount = pool.spec["model"]["mountPath"]
    read_only = {"name": "model", "mountPath": mount, "readOnly": True}
    if "pvc" in source:
        pvc = source["pvc"]
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"],
                                                             "readOnly": pvc.get("readOnly", True)}}
        vm = {"name": "model", "mountPath": mount, "readOnly": pvc.get("readOnly", True)}
        if pvc.get("subPath"):
            vm["subPath"] = pvc["subPath"]
        return ModelMount([volume], [vm])
    if "hostPath" in source:
        volume = {"name": "model", "hostPath": {"path": source["hostPath"]["path"], "type": "Directory"}}
        return ModelMount([volume], [read_only])
    if "objectStore" in source:
        store = source["objectStore"]
        empty = {"sizeLimit": store["sizeLimit"]} if store.get("sizeLimit") is not None else {}
        return ModelMount([{"name": "model", "emptyDir": empty}], [read_only],
                          [download_container(pool, store, mount, weights)])
    if "image" in source:
        image = source["image"]
        volume = {"name": "model", "image": {"reference": image["reference"],
                                             "pullPolicy": image.get("pullPolicy", "IfNotPresent")}}
        return ModelMount([volume], [read_only])
    return ModelMount()


def pod_placement(pool: Pool, role: str) -> dict:
    spec = pool.roles[role]
    out: dict = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = list(spec.tolerations)
    return out


def nodes_selector(pool: Pool) -> dict:
    """Every prefill and decode pod of this pool."""
    return {"matchLabels": pool_selector(pool), "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]}


def topology_affinity(pool: Pool) -> dict | None:
    """Prefill and decode pods in one topology group (rack, NVLink domain): KV moves over the fast fabric."""
    placement = pool.spec.get("placement") or {}
    if not placement.get("topologyKey"):
        return None
    term = {"labelSelector": nodes_selector(pool), "topologyKey": placement["topologyKey"]}
    if placement.get("mode") == "required":
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def transport_settings(pool: Pool) -> tuple[dict | None, list[dict], list[dict]]:
    """(container securityContext, volumes, mounts) for RDMA and shared-memory KV transports."""
    kv = pool.spec["kvTransfer"]
    security = {"capabilities": {"add": ["IPC_LOCK"]}} if (kv.get("rdma") or {}).get("ipcLock") else None
    if kv.get("shmSize") is None:
        return security, [], []
    return security, [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": kv["shmSize"]}}], \
        [{"name": "dshm", "mountPath": "/dev/shm"}]


def node_deployment(pool: Pool, role: str) -> dict:
    cfg = node_config(pool, role)
    role_spec = pool.roles[role]
    model = model_volume(pool)
    security, shm_volumes, shm_mounts = transport_settings(pool)
    volumes, mounts = model.volumes + shm_volumes, model.mounts + shm_mounts
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
        # startup covers model load (the node listens at once and loads on a thread, so it asks readiness: the
        # load must end within loadTimeoutSeconds); after it, liveness restarts a wedged process, readiness gates
        # traffic
        "startupProbe": http_probe(HEALTH_READY, STARTUP_PERIOD,
                                   math.ceil(pool.spec["model"]["loadTimeoutSeconds"] / STARTUP_PERIOD)),
        "livenessProbe": http_probe(HEALTH_LIVE, 10, 3),
        "readinessProbe": http_probe(HEALTH_READY, 5, 2),
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-m", "pdpool.operator.drain", "--port", str(NODE_HTTP_PORT),
            "--wait", str(cfg.disagg.kv_lease_seconds)]}}},
    }
    if security:
        container["securityContext"] = security
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec = {
        "terminationGracePeriodSeconds": pool.termination_grace_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
        **pull_secrets(pool),
        **pod_placement(pool, role),
    }
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    if volumes:
        pod_spec["volumes"] = volumes
    affinity = topology_affinity(pool)
    if affinity:
        pod_spec["affinity"] = affinity
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
