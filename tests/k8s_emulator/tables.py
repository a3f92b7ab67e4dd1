"""Server-side `Table` output for `kubectl get`: CRD printer columns or per-kind defaults."""

from __future__ import annotations

import datetime
import re

from .resources import ResourceType

_STEP = re.compile(r"\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w.-]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]|\['([^']+)'\]")


def json_path(obj, path: str):
    """The subset of JSONPath printer columns use: `.a.b`, `[0]`, `['k']`, `[?(@.type=="Ready")]`."""
    value, rest = obj, path.strip().strip("{}").lstrip("$")
    while rest:
        m = _STEP.match(rest)
        if not m:
            return None
        key, index, filter_key, filter_value, quoted = m.groups()
        rest = rest[m.end():]
        if key is not None or quoted is not None:
            value = value.get(key or quoted) if isinstance(value, dict) else None
        elif index is not None:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        else:
            matches = [x for x in value or [] if isinstance(x, dict) and
                       str(json_path(x, "." + filter_key)) == filter_value] if isinstance(value, list) else []
            value = matches[0] if matches else None
        if value is None:
            return None
    return value


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = max(0, int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * 2 or (unit == "m" and seconds >= 60):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _col(name: str, type_: str = "string", priority: int = 0, description: str = "") -> dict:
    return {"name": name, "type": type_, "format": "name" if name == "Name" else "",
            "description": description, "priority": priority}


def _status(o: dict) -> dict:
    return o.get("status") or {}


def _ready_pods(o: dict) -> str:
    statuses = (o.get("status") or {}).get("containerStatuses") or []
    total = len((o.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _ports(o: dict) -> str:
    ports = (o.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


BUILTIN_COLUMNS = {
    "deployments": [
        ("Ready", lambda o: f"{_status(o).get('readyReplicas', 0)}/{(o.get('spec') or {}).get('replicas', 0)}"),
        ("Up-to-date", lambda o: (o.get("status") or {}).get("updatedReplicas", 0)),
        ("Available", lambda o: (o.get("status") or {}).get("availableReplicas", 0)),
    ],
    "pods": [("Ready", _ready_pods), ("Status", lambda o: (o.get("status") or {}).get("phase", "")),
             ("Restarts", lambda o: 0)],
    "services": [("Type", lambda o: (o.get("spec") or {}).get("type", "")),
                 ("Cluster-IP", lambda o: (o.get("spec") or {}).get("clusterIP", "<none>")),
                 ("Port(s)", _ports)],
    "customresourcedefinitions": [("Created At", lambda o: o["metadata"].get("creationTimestamp", ""))],
    "namespaces": [("Status", lambda o: (o.get("status") or {}).get("phase", ""))],
    "configmaps": [("Data", lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {}))],
    "secrets": [("Type", lambda o: o.get("type", "")), ("Data", lambda o: len(o.get("data") or {}))],
}


def _crd_cell(obj: dict, column: dict):
    value = json_path(obj, column["jsonPath"])
    if value is None:
        return None
    if column.get("type") == "date":
        return age(value)
    if column.get("type") == "integer" and isinstance(value, (int, float)):
        return int(value)
    return value if isinstance(value, (int, float, bool)) else str(value)


def table(rt: ResourceType, items: list[dict], resource_version: str, include_object: str = "Metadata") -> dict:
    if rt.printer_columns:
        columns = [_col("Name", description="Name")] + [
            _col(c["name"], c.get("type", "string"), c.get("priority", 0), c.get("description", ""))
            for c in rt.printer_columns]
        cells = lambda o: [o["metadata"]["name"]] + [_crd_cell(o, c) for c in rt.printer_columns]  # noqa: E731
    else:
        extra = BUILTIN_COLUMNS.get(rt.plural, [])
        with_age = rt.plural != "customresourcedefinitions"
        columns = [_col("Name")] + [_col(n) for n, _ in extra] + [_col("Age")] * with_age
        cells = lambda o: ([o["metadata"]["name"]] + [f(o) for _, f in extra]  # noqa: E731
                           + [age(o["metadata"].get("creationTimestamp"))] * with_age)
    rows = []
    for obj in items:
        if include_object == "Object":
            embedded = obj
        elif include_object == "None":
            embedded = None
        else:
            embedded = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
        rows.append({"cells": cells(obj), "object": embedded})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}
