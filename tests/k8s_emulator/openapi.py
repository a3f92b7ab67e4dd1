"""OpenAPI v3 documents per group-version, built from the built-in JSON schemas and from CRDs.

Each PATCH operation declares the `fieldValidation` query parameter, so kubectl (default
`--validate=strict`) sends `fieldValidation=Strict` and the emulator validates server-side,
as kubectl does against a real 1.35 API server. kubectl also reads these components for
strategic-merge metadata (`x-kubernetes-patch-merge-key`) when it computes `apply` patches.
"""

from __future__ import annotations

import functools
import hashlib
import json

from . import schemas
from .resources import Registry, ResourceType

_PARAMS = [{"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
           for n in ("dryRun", "fieldManager", "fieldValidation", "pretty")]


def _convert(node):
    """JSON-schema form (`type: [T, null]`, `#/$defs/`) → OpenAPI v3 form (`#/components/schemas/`)."""
    if isinstance(node, list):
        return [_convert(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref":
            out["$ref"] = "#/components/schemas/" + value.rsplit("/", 1)[1]
        elif key == "type" and isinstance(value, list):
            types = [t for t in value if t != "null"]
            out["type"] = types[0] if len(types) == 1 else types
        elif key in ("properties", "patternProperties"):
            out[key] = {k: _convert(v) for k, v in value.items()}
        else:
            out[key] = _convert(value)
    if "$ref" in out and len(out) > 1:
        out = {"allOf": [{"$ref": out.pop("$ref")}], **out}
    return out


def _refs(node, found: set) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[1]
            if name not in found:
                found.add(name)
                _refs(schemas.builtin_defs()[name], found)
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


@functools.lru_cache(maxsize=None)
def _builtin_components(names: frozenset) -> dict:
    found = set(names)
    for name in names:
        _refs(schemas.builtin_defs()[name], found)
    out = {n: _convert(schemas.builtin_defs()[n]) for n in sorted(found)}
    out["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": "string", "format": "int-or-string"}
    return out


def _crd_component_name(rt: ResourceType) -> str:
    return ".".join(reversed(rt.group.split("."))) + f".{rt.version}.{rt.kind}"


def _component_name(rt: ResourceType) -> str | None:
    if rt.from_crd:
        return _crd_component_name(rt)
    return schemas.builtin_def_name(rt.group, rt.version, rt.kind)


def _crd_component(rt: ResourceType) -> dict:
    schema = json.loads(json.dumps(rt.crd_schema))
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string"}
    props["kind"] = {"type": "string"}
    props["metadata"] = {"allOf": [{"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}]}
    schema["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
    return schema


def _operation(rt: ResourceType, verb: str, schema_name: str, with_params: bool) -> dict:
    op = {"operationId": f"{verb}{rt.kind}", "x-kubernetes-action": verb,
          "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version, "kind": rt.kind},
          "responses": {"200": {"description": "OK", "content": {"application/json": {
              "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}}}}
    if with_params:
        op["parameters"] = _PARAMS
    return op


def _paths(rt: ResourceType, schema_name: str) -> dict:
    base = f"/apis/{rt.group}/{rt.version}" if rt.group else f"/api/{rt.version}"
    collection = f"{base}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"{base}/{rt.plural}"
    item = collection + "/{name}"
    paths = {
        collection: {"get": _operation(rt, "list", schema_name, False),
                     "post": _operation(rt, "post", schema_name, True)},
        item: {"get": _operation(rt, "get", schema_name, False), "put": _operation(rt, "put", schema_name, True),
               "patch": _operation(rt, "patch", schema_name, True),
               "delete": _operation(rt, "delete", schema_name, False)},
    }
    if rt.status_subresource:
        paths[item + "/status"] = {"get": _operation(rt, "get", schema_name, False),
                                   "put": _operation(rt, "put", schema_name, True),
                                   "patch": _operation(rt, "patch", schema_name, True)}
    return paths


def group_version_document(registry: Registry, group: str, version: str) -> dict | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    names = {_component_name(rt) for rt in types if not rt.from_crd} - {None}
    names.add("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    components = dict(_builtin_components(frozenset(names)))
    paths = {}
    for rt in types:
        name = _component_name(rt)
        if name is None:
            continue
        if rt.from_crd:
            components[name] = _crd_component(rt)
        paths.update(_paths(rt, name))
    title = f"Kubernetes emulator {group or 'core'}/{version}"
    return {"openapi": "3.0.0", "info": {"title": title, "version": "v1.35.0"}, "paths": paths,
            "components": {"schemas": components}}


class OpenApiCache:
    """Serialized documents, rebuilt when the registry's set of types changes."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._generation = -1
        self._docs: dict[str, bytes] = {}

    def _refresh(self) -> None:
        if self._generation == self.registry.generation:
            return
        docs = {}
        for group, versions in self.registry.group_versions().items():
            for version in versions:
                key = f"apis/{group}/{version}" if group else f"api/{version}"
                docs[key] = json.dumps(group_version_document(self.registry, group, version)).encode()
        self._docs, self._generation = docs, self.registry.generation

    def root(self) -> dict:
        self._refresh()
        def url(key: str, doc: bytes) -> str:
            return f"/openapi/v3/{key}?hash={hashlib.sha512(doc).hexdigest()[:32].upper()}"

        return {"paths": {key: {"serverRelativeURL": url(key, doc)} for key, doc in self._docs.items()}}

    def document(self, key: str) -> bytes | None:
        self._refresh()
        return self._docs.get(key)
