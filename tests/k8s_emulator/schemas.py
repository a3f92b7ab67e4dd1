"""Structural schemas: prune unknown fields, apply defaults, validate; for CRDs and built-ins.

One walker serves both schema dialects: a CRD's openAPIV3Schema (`nullable`,
`x-kubernetes-int-or-string`) and the JSON schemas of built-in kinds that the
`kubernetes-validate` package ships (`type: [T, "null"]`, `$ref: #/$defs/...`).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

KUBE_SCHEMA_VERSION = "v1.35.0-local"


@functools.lru_cache(maxsize=1)
def builtin_defs() -> dict:
    import kubernetes_validate

    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / KUBE_SCHEMA_VERSION
    return json.loads((path / "_definitions.json").read_text())["$defs"]


@functools.lru_cache(maxsize=None)
def builtin_def_name(group: str, version: str, kind: str) -> str | None:
    for name, schema in builtin_defs().items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, kind):
                return name
    return None


def resolve_builtin(schema: dict) -> dict:
    while "$ref" in schema:
        schema = builtin_defs()[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _types(schema: dict) -> list[str]:
    t = schema.get("type")
    types = [] if t is None else [t] if isinstance(t, str) else list(t)
    if schema.get("nullable"):
        types.append("null")
    return types


def _preserves(schema: dict) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def _join(path: str, key) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


def prune(value, schema: dict, resolve, path: str, removed: list[str], structural: bool, root: bool = False):
    """Drop fields the schema does not declare; collect their paths in `removed`."""
    schema = resolve(schema)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and extra is None and not structural:
            return  # a free-form object in a built-in schema (RawExtension and the like)
        for key in list(value):
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            if props is not None and key in props:
                prune(value[key], props[key], resolve, _join(path, key), removed, structural)
            elif isinstance(extra, dict):
                prune(value[key], extra, resolve, _join(path, key), removed, structural)
            elif extra is True or _preserves(schema):
                continue
            else:
                removed.append(_join(path, key))
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            prune(item, schema["items"], resolve, _join(path, i), removed, structural)


def apply_defaults(value, schema: dict) -> None:
    """CRD `default`s, applied top-down to objects that exist (as the API server does)."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])


_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[t])


def _json_type(value) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), "null")


def _show(value) -> str:
    return json.dumps(value)[:80]


def validate(value, schema: dict, resolve, path: str = "", root: bool = False) -> list[dict]:
    """Causes in the API server's shape: {"reason", "message", "field"}."""
    schema = resolve(schema)
    if value is None and "null" in _types(schema):
        return []
    if "oneOf" in schema and not schema.get("properties"):
        alternatives = [validate(value, s, resolve, path) for s in schema["oneOf"]]
        return [] if any(not a for a in alternatives) else alternatives[0]
    if schema.get("x-kubernetes-int-or-string"):
        types = ["integer", "string"]
    else:
        types = [t for t in _types(schema) if t != "null"]
    if types and not any(_type_ok(value, t) for t in types):
        return [_cause("FieldValueTypeInvalid", path, value,
                       f"{path} in body must be of type {','.join(types)}: {_show(_json_type(value))}")]
    causes = []
    for sub_schema in schema.get("allOf") or []:
        causes += validate(value, sub_schema, resolve, path)
    if schema.get("anyOf") and all(validate(value, s, resolve, path) for s in schema["anyOf"]):
        causes.append(_cause("FieldValueInvalid", path, value, f"{path} in body must match at least one schema"))
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_show(v) for v in schema["enum"])
        causes.append({"reason": "FieldValueNotSupported", "field": path,
                       "message": f"Unsupported value: {_show(value)}: supported values: {supported}"})
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and (value < schema["minimum"] or
                                    (schema.get("exclusiveMinimum") is True and value == schema["minimum"])):
            causes.append(_cause("FieldValueInvalid", path, value,
                                 f"{path} in body should be greater than or equal to {schema['minimum']}"))
        if "maximum" in schema and (value > schema["maximum"] or
                                    (schema.get("exclusiveMaximum") is True and value == schema["maximum"])):
            causes.append(_cause("FieldValueInvalid", path, value,
                                 f"{path} in body should be less than or equal to {schema['maximum']}"))
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            causes.append(_cause("FieldValueInvalid", path, value,
                                 f"{path} in body should match '{schema['pattern']}'"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            causes.append(_cause("FieldValueInvalid", path, value,
                                 f"{path} in body should be at least {schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            causes.append({"reason": "FieldValueTooLong", "field": path,
                           "message": f"Too long: may not be more than {schema['maxLength']} bytes"})
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(_cause("FieldValueInvalid", path, value,
                                 f"{path} in body should have at least {schema['minItems']} items"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append({"reason": "FieldValueTooMany", "field": path,
                           "message": f"Too many: {len(value)}: must have at most {schema['maxItems']} items"})
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                causes += validate(item, schema["items"], resolve, _join(path, i))
    if isinstance(value, dict):
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:  # as maxItems (field.TooMany)
            causes.append({"reason": "FieldValueTooMany", "field": path,
                           "message": f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"})
        for key in schema.get("required", []):
            if key not in value and not (root and key in ("apiVersion", "kind", "metadata")):
                causes.append({"reason": "FieldValueRequired", "field": _join(path, key),
                               "message": "Required value"})
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            if key in props:
                causes += validate(item, props[key], resolve, _join(path, key))
            elif isinstance(extra, dict):
                causes += validate(item, extra, resolve, _join(path, key))
    return causes


def _cause(reason: str, path: str, value, detail: str) -> dict:
    return {"reason": reason, "field": path, "message": f"Invalid value: {_show(value)}: {detail}"}


def crd_resolve(schema: dict) -> dict:
    return schema
