"""What the API server does to a written object before storing it: prune, default, validate."""

from __future__ import annotations

import re

from . import schemas
from .errors import ApiError, invalid
from .resources import ResourceType

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_KINDS = {"namespaces", "services"}  # resources whose names must be DNS-1123 labels


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
    pattern = DNS_LABEL if rt.plural in LABEL_KINDS else DNS_SUBDOMAIN
    limit = 63 if rt.plural in LABEL_KINDS else 253
    if not pattern.match(name) or len(name) > limit:
        raise invalid(rt, name, [{"reason": "FieldValueInvalid", "field": "metadata.name",
                                  "message": f'Invalid value: "{name}": a lowercase RFC 1123 name must consist '
                                             "of lower case alphanumeric characters, '-' or '.'"}])
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
    if causes:
        if not structural and any(c["reason"] == "FieldValueTypeInvalid" for c in causes):
            first = next(c for c in causes if c["reason"] == "FieldValueTypeInvalid")
            raise ApiError(400, f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                                f'{first["field"]}: {first["message"]}')
        raise invalid(rt, obj["metadata"].get("name", ""), causes)
    return [f'unknown field "{f}"' for f in removed]
