"""Server-side defaults of built-in kinds, the ones controllers and `kubectl get -o yaml` show.

Real API servers fill these in on every write, so an operator that diffs its desired
spec against the stored one must tolerate them; the emulator keeps that pressure.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
from fractions import Fraction

from .resources import ResourceType

_cluster_ips = itertools.count(1)
_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")


def canonical_quantity(value):
    """A resource.Quantity as the API server stores it: 1000m -> 1, 0.5 -> 500m, 2000 -> 2k, 1024Mi -> 1Gi,
    an integer 1 -> "1" (apimachinery's CanonicalizeBytes). A value that is no quantity is left alone."""
    match = _QUANTITY.fullmatch(str(value).strip())
    if isinstance(value, bool) or not match:
        return value
    number, suffix = Fraction(match[1]), match[2] or ""
    if suffix in _BINARY[1:]:
        exact = number * 1024 ** _BINARY.index(suffix)
        if abs(exact) >= 1024 and exact.denominator == 1:
            n, power = int(exact), 0
            while power < 6 and n % 1024 == 0:
                n, power = n // 1024, power + 1
            return f"{n}{_BINARY[power]}"
        number, suffix = exact, ""
    exponent_form = suffix[:1] in ("e", "E")
    exact = number * Fraction(10) ** (int(suffix[1:]) if exponent_form else _DECIMAL[suffix])
    exact = Fraction(math.ceil(exact * 10 ** 9), 10 ** 9)  # below 1n rounds up
    if exact == 0:
        return "0"
    scale = -9
    while scale < 18 and (exact / Fraction(10) ** (scale + 3)).denominator == 1:
        scale += 3
    mantissa = int(exact / Fraction(10) ** scale)
    if exponent_form:
        return f"{mantissa}e{scale}" if scale else str(mantissa)
    return f"{mantissa}{next(s for s, e in _DECIMAL.items() if e == scale)}"


def _container(c: dict) -> None:
    image = c.get("image", "")
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else "latest"
    c.setdefault("imagePullPolicy", "Always" if tag == "latest" else "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    resources = c.setdefault("resources", {})
    for section in ("limits", "requests"):
        if isinstance(resources.get(section), dict):
            resources[section] = {k: canonical_quantity(v) for k, v in resources[section].items()}
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")


def pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for volume in spec.get("volumes") or []:
        empty_dir = volume.get("emptyDir") if isinstance(volume, dict) else None
        if isinstance(empty_dir, dict) and "sizeLimit" in empty_dir:
            empty_dir["sizeLimit"] = canonical_quantity(empty_dir["sizeLimit"])
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
