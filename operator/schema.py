"""Spec fields that shape the Kubernetes objects, not a process flag.

Every other leaf of the InferencePool spec is a setting of ``pdpool.config`` (its ``crd`` path), so CLI flags and
CRD cannot drift. ``DEPLOYMENT_FIELDS`` maps each deployment-only path to its OpenAPI schema; the CRD generator
merges both trees, and a test checks that every leaf is one or the other.
"""

from __future__ import annotations

DEFAULT_IMAGE = "ghcr.io/pdpool/pdpool:0.1.0"
DEFAULT_REDIS_IMAGE = "redis:7.4-alpine"
DEFAULT_DOWNLOAD_IMAGE = "amazon/aws-cli:2.22.35"


def _str(description: str, **kw) -> dict:
    return {"type": "string", "description": description, **kw}


def _int(description: str, **kw) -> dict:
    return {"type": "integer", "description": description, **kw}


def _secret_ref(description: str, default_key: str) -> dict:
    return {"type": "object", "description": description, "required": ["name"], "properties": {
        "name": _str("Secret name, in the pool's namespace."),
        "key": _str("Key in the Secret.", default=default_key),
    }}


_QUANTITIES = {"type": "object", "additionalProperties": {
    "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}}

RESOURCES = {"type": "object", "description": "Container resources, e.g. limits: {nvidia.com/gpu: 1}.",
             "properties": {"requests": _QUANTITIES, "limits": _QUANTITIES}}

TOLERATIONS = {"type": "array", "description": "Pod tolerations (e.g. for GPU node taints).", "items": {
    "type": "object", "properties": {
        "key": _str("Taint key."),
        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _str("Taint value."),
        "effect": _str("Taint effect.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": _int("Seconds a NoExecute taint is tolerated."),
    }}}

ENV = {"type": "array", "description": "Extra environment variables of the container.", "items": {
    "type": "object", "required": ["name"], "properties": {
        "name": _str("Variable name."),
        "value": _str("Value."),
        "valueFrom": {"type": "object", "description": "As in a Pod's env[].valueFrom.",
                      "x-kubernetes-preserve-unknown-fields": True},
    }}}


IMAGE_PULL_SECRETS = {
    "type": "array", "description": "Secrets (kubernetes.io/dockerconfigjson, in the pool's namespace) to pull "
    "images with: set on every pod of the pool (prefill, decode, router, the managed Redis), so they cover "
    "image, redis.image, model.source.image and model.source.objectStore.image.",
    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
    "items": {"type": "object", "required": ["name"], "properties": {"name": _str("Secret name.")}}}


def _role(role: str) -> dict[str, dict]:
    return {
        f"{role}.replicas": _int(f"{role} pods. Leave unset when an HPA or KEDA scales them; the operator then "
                                 "never writes the Deployment's replicas.", minimum=0),
        f"{role}.resources": RESOURCES,
        f"{role}.nodeSelector": {"type": "object", "description": "Pod nodeSelector.",
                                 "additionalProperties": {"type": "string"}},
        f"{role}.tolerations": TOLERATIONS,
        f"{role}.env": ENV,
    }


_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

_PEERS = {"type": "array", "description": "NetworkPolicy peers (podSelector, namespaceSelector, ipBlock) allowed to "
          "reach the nodes' and the router's HTTP port, for example Prometheus scraping /metrics.", "items": {
              "type": "object", "x-kubernetes-preserve-unknown-fields": True}}

MODEL_SOURCE = {
    "type": "object", "description": "Where model.name lives when it is not 'demo' or a path baked into the image: "
    "set one of pvc, hostPath, objectStore, image; it is mounted at model.mountPath.",
    "maxProperties": 1,
    "properties": {
        "pvc": {"type": "object", "description": "A PersistentVolumeClaim, e.g. holding a Hugging Face cache.",
                "required": ["claimName"], "properties": {
                    "claimName": _str("PersistentVolumeClaim name."),
                    "subPath": _str("Folder inside the volume."),
                    "readOnly": {"type": "boolean", "default": True, "description": "Mount read-only."},
                }},
        "hostPath": {"type": "object", "description": "A folder on each node.", "required": ["path"],
                     "properties": {"path": _str("Folder on the node.")}},
        "objectStore": {"type": "object", "description": "Downloaded by an init container (aws s3 sync) into an "
                        "emptyDir before the engine starts; each pod downloads its own copy.",
                        "required": ["uri"], "properties": {
                            "uri": _str("s3://bucket/prefix (any S3-compatible store).", pattern="^s3://.+"),
                            "endpointUrl": _str("S3 endpoint of a non-AWS store (MinIO, Ceph, GCS interop)."),
                            "credentialsSecretRef": {"type": "object", "required": ["name"],
                                                     "description": "Secret whose keys become the init "
                                                     "container's environment (AWS_ACCESS_KEY_ID, ...).",
                                                     "properties": {"name": _str("Secret name.")}},
                            "image": _str("Image of the download container.", default=DEFAULT_DOWNLOAD_IMAGE),
                            "sizeLimit": {**_QUANTITY, "description": "Size limit of the emptyDir."},
                        }},
        "image": {"type": "object", "description": "An OCI image (artifact) mounted read-only as an image volume "
                  "(Kubernetes ImageVolume: beta in 1.33, on by default from 1.35).",
                  "required": ["reference"], "properties": {
                      "reference": _str("Image reference holding the model files."),
                      "pullPolicy": _str("Pull policy.", enum=["Always", "IfNotPresent", "Never"],
                                         default="IfNotPresent"),
                  }},
    }}

DEPLOYMENT_FIELDS: dict[str, dict] = {
    "image": _str("Image with the pdpool package, for nodes and router.", default=DEFAULT_IMAGE),
    "imagePullPolicy": _str("Pull policy of that image.", enum=["Always", "IfNotPresent", "Never"],
                            default="IfNotPresent"),
    # no schema default: a cluster may set it for every pool in the operator's --pool-defaults
    "imagePullSecrets": IMAGE_PULL_SECRETS,
    "model.source": MODEL_SOURCE,
    "model.mountPath": _str("Where the model source is mounted; model.name must then lie under it.",
                            default="/models"),
    "model.loadTimeoutSeconds": _int("Seconds a node may take to load the model before its startupProbe fails "
                                     "(size it for a cold load of the largest model: download, read, warm-up).",
                                     minimum=30, default=600),
    **_role("prefill"),
    **_role("decode"),
    "router.replicas": _int("Router pods. Leave unset when an HPA or KEDA scales them (a new Deployment starts "
                            "with 1); the operator then never writes the Deployment's replicas.", minimum=0),
    "router.resources": RESOURCES,
    "router.service.type": _str("Service type of the router.", enum=["ClusterIP", "NodePort", "LoadBalancer"],
                                default="ClusterIP"),
    "router.service.port": _int("Service port of the router.", minimum=1, maximum=65535, default=80),
    "router.apiKeySecretRef": _secret_ref("Secret with the API key clients present (PDPOOL_API_KEY).",
                                          "api-key"),
    "redis.passwordSecretRef": _secret_ref("Secret with the password of the external Redis at redis.url.",
                                           "password"),
    "redis.image": _str("Image of the managed Redis (used when redis.url is unset).", default=DEFAULT_REDIS_IMAGE),
    "router.discovery": _str("How the router finds nodes: redis (heartbeats; the router's pods get no Kubernetes "
                             "token) or kubernetes (EndpointSlices of the node Services; the operator creates a "
                             "ServiceAccount with a read-only Role on EndpointSlices for the router).",
                             enum=["redis", "kubernetes"], default="redis"),
    # No schema defaults below: the API server would write them into every pool, and a pool's value beats the
    # operator's --pool-defaults, where clusters set these (unset means false / preferred).
    "kvTransfer.rdma.ipcLock": {"type": "boolean", "description": "Add the IPC_LOCK capability "
                                "to the nodes, so that RDMA can pin KV memory beyond RLIMIT_MEMLOCK (see "
                                "docs/deploy.md: a non-root process also needs the runtime's memlock limit)."},
    "kvTransfer.shmSize": {**_QUANTITY, "description": "Size of a memory-backed /dev/shm for the nodes (UCX "
                           "shared-memory and CUDA IPC transports), e.g. 16Gi; unset: the runtime's 64Mi."},
    "placement.topologyKey": _str("Node label whose value groups nodes that share a fast fabric (rack, NVLink "
                                  "domain), e.g. nvidia.com/gpu.clique or topology.kubernetes.io/zone: the pool's "
                                  "prefill and decode pods are placed in the same group."),
    "placement.mode": _str("preferred (unset: a scheduling preference) or required (pods wait for room in one "
                           "group).", enum=["preferred", "required"]),
    "networkPolicy.scrapeFrom": _PEERS,
}

SECTION_DESCRIPTIONS = {
    "model": "The model every node serves.",
    "engine": "Engine settings shared by prefill and decode nodes.",
    "prefill": "The prefill role: nodes that compute prompts' KV and lease it to decode nodes.",
    "decode": "The decode role: nodes that pull KV and generate tokens.",
    "router": "The OpenAI gateway in front of the pool.",
    "router.service": "The router's Service.",
    "router.weights": "Scorer weights of the router's endpoint picker.",
    "redis": "Block-ownership index and heartbeats: managed by the operator unless redis.url is set.",
    "kvTransfer": "KV movement between prefill and decode nodes.",
    "kvTransfer.rdma": "RDMA settings of the node pods (RDMA devices themselves are resources, e.g. rdma/ib).",
    "placement": "Topology-aware placement of the pool's prefill and decode pods.",
    "cors": "CORS of the pool's router (what a browser's page calls) and nodes, as vLLM's flags: any origin, method "
            "and header unless listed; an empty list allows none.",
    "networkPolicy": "The pool's NetworkPolicies: router → nodes' HTTP, nodes ↔ nodes (NIXL, UCX), Redis.",
}
