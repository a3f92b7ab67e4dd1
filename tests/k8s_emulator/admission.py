"""What the API server does to a written object before storing it: prune, default, validate."""

from __future__ import annotations

import re

from . import schemas
from .errors import ApiError, invalid
from .resources import ResourceType

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# resources whose names must be labels: pattern, and how the API server's message names it
LABEL_KINDS = {"namespaces": (DNS_LABEL, "a lowercase RFC 1123 label must consist of lower case alphanumeric "
                                         "characters or '-', and must start and end with an alphanumeric character"),
               "services": (DNS_1035_LABEL, "a DNS-1035 label must consist of lower case alphanumeric characters or "
                                            "'-', start with an alphabetic character, and end with an alphanumeric "
                                            "character")}


def _schema_of(rt: ResourceType):
    if rt.crd_schema is not None:
        return rt.crd_schema, schemas.crd_resolve, True
    name = schemas.builtin_def_name(rt.group, rt.version, rt.kind)
    if name is None:
        return None, None, False
    return {"$ref": f"#/$defs/{name}"}, schemas.resolve_builtin, False


def validate_metadata(rt: ResourceType, obj: dict) -> None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise invalid(rt, "", [{"reason": "FieldValueRequired", "field": "metadata", "message": "Required value"}])
    name = meta.get("name", "")
    pattern, what = LABEL_KINDS.get(rt.plural, (DNS_SUBDOMAIN, "a lowercase RFC 1123 name must consist of lower "
                                                              "case alphanumeric characters, '-' or '.'"))
    limit = 63 if rt.plural in LABEL_KINDS else 253
    if len(name) > limit:
        raise invalid(rt, name, [{"reason": "FieldValueInvalid", "field": "metadata.name",
                                  "message": f'Invalid value: "{name}": must be no more than {limit} characters'}])
    if not pattern.match(name):
        raise invalid(rt, name, [{"reason": "FieldValueInvalid", "field": "metadata.name",
                                  "message": f'Invalid value: "{name}": {what}'}])
    for key in ("labels", "annotations"):
        values = meta.get(key) or {}
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            raise ApiError(400, f"{rt.kind} in version \"{rt.version}\" cannot be handled as a {rt.kind}: "
                                f"metadata.{key} must map strings to strings")


def admit(rt: ResourceType, obj: dict, field_validation: str | None) -> list[str]:
    """Prunes, defaults and validates `obj` in place; returns warnings for pruned fields."""
    schema, resolve, structural = _schema_of(rt)
    if schema is None:
        return []
    removed: list[str] = []
    schemas.prune(obj, schema, resolve, "", removed, structural, root=True)
    if removed and (field_validation or "").lower() == "strict":
        fields = ", ".join(f'unknown field "{f}"' for f in removed)
        raise ApiError(400, f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                            f"strict decoding error: {fields}")
    if structural:
        schemas.apply_defaults(obj, schema)
    causes = schemas.validate(obj, schema, resolve, "", root=True)
    if structural:  # a CRD may restrict metadata.name and metadata.generateName, and nothing else of metadata
        meta_props = ((schema.get("properties") or {}).get("metadata") or {}).get("properties") or {}
        for key in ("name", "generateName"):
            if key in meta_props and key in obj["metadata"]:
                causes += schemas.validate(obj["metadata"][key], meta_props[key], resolve, f"metadata.{key}")
    if causes:
        if not structural and any(c["reason"] == "FieldValueTypeInvalid" for c in causes):
            first = next(c for c in causes if c["reason"] == "FieldValueTypeInvalid")
            raise ApiError(400, f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                                f'{first["field"]}: {first["message"]}')
        raise invalid(rt, obj["metadata"].get("name", ""), causes)
    return [f'unknown field "{f}"' for f in removed]
