"""CustomResourceDefinitions: check one, report it Established, turn it into served types."""

from __future__ import annotations

import datetime

from .errors import invalid
from .resources import ResourceType


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check(rt, crd: dict) -> None:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    name = crd["metadata"]["name"]
    causes = []
    expected = f"{names.get('plural')}.{spec.get('group')}"
    if name != expected:
        causes.append({"reason": "FieldValueInvalid", "field": "metadata.name",
                       "message": f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group'})
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append({"reason": "FieldValueNotSupported", "field": "spec.scope",
                       "message": 'Unsupported value: supported values: "Cluster", "Namespaced"'})
    versions = spec.get("versions") or []
    if not versions:
        causes.append({"reason": "FieldValueRequired", "field": "spec.versions", "message": "Required value"})
    if versions and sum(bool(v.get("storage")) for v in versions) != 1:
        causes.append({"reason": "FieldValueInvalid", "field": "spec.versions",
                       "message": "Invalid value: must have exactly one version marked as storage version"})
    for i, v in enumerate(versions):
        if not (v.get("schema") or {}).get("openAPIV3Schema"):
            causes.append({"reason": "FieldValueRequired", "field": f"spec.versions[{i}].schema.openAPIV3Schema",
                           "message": "Required value: schemas are required"})
    if causes:
        raise invalid(rt, name, causes)


def established_status(crd: dict) -> dict:
    spec = crd["spec"]
    now = _now()
    accepted = dict(spec["names"])
    accepted.setdefault("singular", accepted["kind"].lower())
    accepted.setdefault("listKind", accepted["kind"] + "List")
    return {
        "acceptedNames": accepted,
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
    }


def served_types(crd: dict) -> list[ResourceType]:
    spec = crd["spec"]
    names = spec["names"]
    return [
        ResourceType(
            group=spec["group"], version=v["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope") == "Namespaced",
            status_subresource="status" in (v.get("subresources") or {}),
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            tracks_generation=True, crd_schema=v["schema"]["openAPIV3Schema"],
            printer_columns=v.get("additionalPrinterColumns"), from_crd=True,
            scale=(v.get("subresources") or {}).get("scale"),
        )
        for v in spec["versions"] if v.get("served", True)
    ]
