"""Server-side defaults of built-in kinds, the ones controllers and `kubectl get -o yaml` show.

Real API servers fill these in on every write, so an operator that diffs its desired
spec against the stored one must tolerate them; the emulator keeps that pressure.
"""

from __future__ import annotations

import base64
import itertools

from .resources import ResourceType

_cluster_ips = itertools.count(1)


def _container(c: dict) -> None:
    image = c.get("image", "")
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else "latest"
    c.setdefault("imagePullPolicy", "Always" if tag == "latest" else "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("resources", {})
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")


def pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if isinstance(c, dict):
            _container(c)


def _workload(spec: dict, plural: str) -> None:
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    if plural == "deployments":
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault("strategy", {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}})
    if plural == "statefulsets":
        spec.setdefault("podManagementPolicy", "OrderedReady")
        spec.setdefault("updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}})
    template_spec = (spec.get("template") or {}).get("spec")
    if isinstance(template_spec, dict):
        pod_spec(template_spec)


def _service(spec: dict) -> None:
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName" and not spec.get("clusterIP"):
        n = next(_cluster_ips)
        spec["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
    if spec.get("clusterIP") and spec["clusterIP"] != "None":
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))


def _secret(obj: dict) -> None:
    obj.setdefault("type", "Opaque")
    string_data = obj.pop("stringData", None) or {}
    if string_data:
        data = obj.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def carry_over(rt: ResourceType, old: dict, new: dict) -> None:
    """Allocated values an update may omit: a Service keeps its cluster IPs."""
    if rt.plural == "services" and isinstance(new.get("spec"), dict):
        for key in ("clusterIP", "clusterIPs"):
            if key in (old.get("spec") or {}) and not new["spec"].get(key):
                new["spec"][key] = old["spec"][key]


def apply(rt: ResourceType, obj: dict) -> None:
    spec = obj.get("spec")
    if rt.plural in ("deployments", "statefulsets", "replicasets") and isinstance(spec, dict):
        _workload(spec, rt.plural)
    elif rt.plural == "pods" and isinstance(spec, dict):
        pod_spec(spec)
        obj.setdefault("status", {}).setdefault("phase", "Pending")
    elif rt.plural == "services" and isinstance(spec, dict):
        _service(spec)
    elif rt.plural == "secrets":
        _secret(obj)
    elif rt.plural == "namespaces":
        obj.setdefault("status", {}).setdefault("phase", "Active")
