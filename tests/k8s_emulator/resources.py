"""Resource types the emulator serves: built-ins, plus those that CRDs add at run time."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    short_names: list[str] = field(default_factory=list)
    tracks_generation: bool = False
    crd_schema: dict | None = None          # a CRD version's openAPIV3Schema
    printer_columns: list[dict] | None = None  # a CRD version's additionalPrinterColumns
    categories: list[str] = field(default_factory=list)
    from_crd: bool = False
    scale: dict | None = None  # {"specReplicasPath", "statusReplicasPath", "labelSelectorPath"}

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        return self.api_version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def store_key(self) -> tuple[str, str]:
        """Objects are stored once per group+plural, whatever version they are served at."""
        return (self.group, self.plural)


WORKLOAD = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}


def _rt(gv: str, plural: str, kind: str, **kw) -> ResourceType:
    group, _, version = gv.rpartition("/")
    return ResourceType(group, version, plural, kind, **kw)


BUILTINS = [
    _rt("v1", "namespaces", "Namespace", namespaced=False, status_subresource=True, short_names=["ns"]),
    _rt("v1", "pods", "Pod", categories=["all"], status_subresource=True, short_names=["po"], tracks_generation=True),
    _rt("v1", "services", "Service", categories=["all"], status_subresource=True, short_names=["svc"]),
    _rt("v1", "configmaps", "ConfigMap", short_names=["cm"]),
    _rt("v1", "secrets", "Secret"),
    _rt("v1", "events", "Event", short_names=["ev"]),
    _rt("v1", "endpoints", "Endpoints", short_names=["ep"]),
    _rt("v1", "serviceaccounts", "ServiceAccount", short_names=["sa"]),
    _rt("v1", "persistentvolumeclaims", "PersistentVolumeClaim", status_subresource=True, short_names=["pvc"]),
    _rt("apps/v1", "deployments", "Deployment", categories=["all"], scale=WORKLOAD,
        status_subresource=True, short_names=["deploy"],
        tracks_generation=True),
    _rt("apps/v1", "statefulsets", "StatefulSet", categories=["all"], scale=WORKLOAD,
        status_subresource=True, short_names=["sts"],
        tracks_generation=True),
    _rt("apps/v1", "replicasets", "ReplicaSet", categories=["all"], scale=WORKLOAD,
        status_subresource=True, short_names=["rs"],
        tracks_generation=True),
    _rt("apps/v1", "daemonsets", "DaemonSet", categories=["all"], status_subresource=True, short_names=["ds"],
        tracks_generation=True),
    _rt("batch/v1", "jobs", "Job", categories=["all"], status_subresource=True, tracks_generation=True),
    _rt("batch/v1", "cronjobs", "CronJob", categories=["all"], status_subresource=True, short_names=["cj"],
        tracks_generation=True),
    _rt("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", categories=["all"],
        status_subresource=True, short_names=["hpa"]),
    _rt("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _rt("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _rt("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", namespaced=False),
    _rt("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    _rt("coordination.k8s.io/v1", "leases", "Lease"),
    _rt("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short_names=["netpol"],
        tracks_generation=True),
    _rt("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", status_subresource=True,
        short_names=["pdb"], tracks_generation=True),
    _rt("events.k8s.io/v1", "events", "Event", short_names=["ev"]),
    _rt("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False,
        status_subresource=True, short_names=["crd", "crds"], tracks_generation=True),
]


class Registry:
    """(group, version, plural) → ResourceType; CRDs register and unregister their versions."""

    def __init__(self):
        self._lock = threading.Lock()
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self.generation = 0  # bumps whenever the set of served types changes (discovery/openapi caches)
        for rt in BUILTINS:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def all(self) -> list[ResourceType]:
        with self._lock:
            return list(self._types.values())

    def group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for rt in self.all():
            versions = out.setdefault(rt.group, [])
            if rt.version not in versions:
                versions.append(rt.version)
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [rt for rt in self.all() if rt.group == group and rt.version == version]

    def versions_of(self, group: str, plural: str) -> list[ResourceType]:
        return [rt for rt in self.all() if rt.group == group and rt.plural == plural]

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        return next((rt for rt in self.all() if rt.api_version == api_version and rt.kind == kind), None)

    def replace_crd(self, group: str, plural: str, types: list[ResourceType]) -> None:
        with self._lock:
            for key in [k for k, rt in self._types.items() if rt.from_crd and (k[0], k[2]) == (group, plural)]:
                del self._types[key]
            for rt in types:
                self._types[(rt.group, rt.version, rt.plural)] = rt
            self.generation += 1
