"""The InferencePool CustomResourceDefinition, generated from ``pdpool.config`` and ``schema.DEPLOYMENT_FIELDS``.

``operator/crd.yaml`` is the committed rendering (``pdpool operator crd`` prints it); a test fails if it drifts.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

import yaml

from pdpool import config
from pdpool.operator import schema

GROUP, VERSION, KIND, PLURAL, SINGULAR = "pdpool.io", "v1alpha1", "InferencePool", "inferencepools", "inferencepool"
SHORT_NAMES = ["pdpool"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_PATH = pathlib.Path(__file__).with_name("crd.yaml")

# Processes whose settings the spec configures: pdpool serve (prefill, decode) and pdpool router.
CONFIGURED = (config.NodeConfig, config.RouterCommandConfig)

# A pool's name names its Services ("<pool>", "<pool>-prefill", "<pool>-decode", "<pool>-redis"): DNS-1035 labels
# of at most 63 characters, the longest suffix being "-prefill". The API server refuses a longer name up front,
# instead of the operator failing on every child Service.
MAX_POOL_NAME = 63 - len("-prefill")
POOL_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def setting_default(f: dataclasses.Field) -> Any:
    """The setting's default (a list setting's from its factory); None: none."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def setting_schema(f: dataclasses.Field) -> dict:
    m = f.metadata
    if config._base_type(f) is list:  # a list flag (--allowed-origins): a list of strings, atomic as a whole
        item: dict[str, Any] = {"type": "string"}
        out: dict[str, Any] = {"type": "array", "items": item, "description": m["help"]}
    else:
        item = out = {"type": _TYPES[config._base_type(f)], "description": m["help"]}
    if m.get("pattern"):
        item["pattern"] = m["pattern"]
    if m.get("choices"):
        out["enum"] = list(m["choices"])
    if m.get("ge") is not None:
        out["minimum"] = m["ge"]
    if m.get("le") is not None:
        out["maximum"] = m["le"]
    if setting_default(f) is not None:
        out["default"] = setting_default(f)
    return out


def config_fields() -> dict[str, list[tuple[type, dataclasses.Field]]]:
    """crd path → the (composite config, field) pairs it sets; one path may set the same name in two processes."""
    out: dict[str, list] = {}
    for cfg_cls in CONFIGURED:
        for _, f in config.all_options(cfg_cls):
            if f.metadata.get("crd"):
                out.setdefault(f.metadata["crd"], []).append((cfg_cls, f))
    return out


def spec_leaves() -> dict[str, dict]:
    """Every leaf path of the spec and its schema."""
    leaves = {}
    for path, users in config_fields().items():
        schemas = [setting_schema(f) for _, f in users]
        shapes = [{k: v for k, v in s.items() if k != "description"} for s in schemas]
        if any(shape != shapes[0] for shape in shapes):
            raise AssertionError(f"{path}: declared differently by {[c.__name__ for c, _ in users]}")
        leaves[path] = schemas[0]
    overlap = set(leaves) & set(schema.DEPLOYMENT_FIELDS)
    if overlap:
        raise AssertionError(f"both a config setting and a deployment field: {sorted(overlap)}")
    leaves.update(schema.DEPLOYMENT_FIELDS)
    return leaves


def spec_schema() -> dict:
    root: dict = {"type": "object", "properties": {}}
    for path, leaf in sorted(spec_leaves().items()):
        node, parts = root, path.split(".")
        for i, part in enumerate(parts[:-1]):
            prefix = ".".join(parts[: i + 1])
            node = node["properties"].setdefault(part, {
                "type": "object", "description": schema.SECTION_DESCRIPTIONS.get(prefix, ""),
                "default": {}, "properties": {}})
        node["properties"][parts[-1]] = copy.deepcopy(leaf)
    root["description"] = "An LLM serving pool with prefill/decode disaggregation."
    return root


def _condition_schema() -> dict:
    s = {"type": "string"}
    return {"type": "object", "required": ["type", "status"], "properties": {
        "type": s, "status": {"type": "string", "enum": ["True", "False", "Unknown"]}, "reason": s, "message": s,
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"}}}


def _role_status() -> dict:
    i = {"type": "integer"}
    return {"type": "object", "properties": {"desired": i, "ready": i, "updated": i, "summary": {"type": "string"}}}


def status_schema() -> dict:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
        "observedGeneration": {"type": "integer"},
        "phase": {"type": "string", "enum": ["Pending", "Progressing", "Ready", "Degraded"]},
        "endpoint": {"type": "string", "description": "URL of the router's Service."},
        "replicas": {"type": "object", "properties": {r: _role_status() for r in ("prefill", "decode", "router")}},
        "conditions": {"type": "array", "items": _condition_schema(),
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    }}


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.replicas.prefill.summary"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.replicas.decode.summary"},
    {"name": "Router", "type": "string", "jsonPath": ".status.replicas.router.summary"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "pdpool",
                                                  "app.kubernetes.io/component": "operator"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "listKind": KIND + "List", "categories": ["pdpool"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object", "required": ["spec"],
                    "description": "InferencePool (pdpool.io): prefill, decode and router Deployments around one "
                                   "model. Not the Gateway API's inferencepools.inference.networking.k8s.io.",
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        # only name and generateName may be restricted here (structural schema rules)
                        "metadata": {"type": "object", "properties": {"name": {
                            "type": "string", "maxLength": MAX_POOL_NAME, "pattern": POOL_NAME_PATTERN}}},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    }}},
            }],
        },
    }


def render_crd() -> str:
    header = "# Generated by `pdpool operator crd` from pdpool/config.py and operator/schema.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def apply_defaults(value: Any, node_schema: dict) -> Any:
    """Apply the schema's defaults as the API server does (a missing object with ``default: {}`` recurses)."""
    if node_schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for name, sub in node_schema.get("properties", {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(out[name], sub)
    return out


def strict_spec_schema(settable_by_default: bool = False) -> dict:
    """The spec's schema as JSON Schema for Helm's values.schema.json: unknown fields rejected (the API server
    would prune them silently). ``settable_by_default``: only the leaves an operator's --pool-defaults can set,
    those without a CRD default (the API server writes those defaults into every pool, and they win)."""

    def strict(node: dict) -> dict | None:
        if settable_by_default and "default" in node and node.get("type") != "object":
            return None
        out = {k: copy.deepcopy(v) for k, v in node.items()
               if not k.startswith("x-kubernetes-") and k not in ("properties", "items", "default")}
        if "properties" in node:
            props = {name: s for name, sub in node["properties"].items() if (s := strict(sub)) is not None}
            out["properties"] = props
            if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
                out["additionalProperties"] = False
        if "items" in node:
            out["items"] = strict(node["items"]) or {}
        if isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = strict(node["additionalProperties"])
        if "anyOf" in node:
            out["anyOf"] = [strict(alt) for alt in node["anyOf"]]
        return out

    return strict(spec_schema())


def _json_type_ok(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}[t])


def schema_errors(value, node: dict, path: str) -> list[str]:
    """What the API server would refuse (types, enums, bounds, patterns, required and unknown fields)."""
    if "anyOf" in node and not any(not schema_errors(value, alt, path) for alt in node["anyOf"]):
        return [f"{path}: {value!r} matches none of {[alt.get('type') for alt in node['anyOf']]}"]
    t = node.get("type")
    if t and not _json_type_ok(value, t):
        return [f"{path}: expected {t}, got {value!r}"]
    errors = []
    if "enum" in node and value not in node["enum"]:
        errors.append(f"{path}: {value!r} is not one of {node['enum']}")
    if "minimum" in node and value < node["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {node['minimum']}")
    if "maximum" in node and value > node["maximum"]:
        errors.append(f"{path}: {value} is above the maximum {node['maximum']}")
    if "pattern" in node and t == "string" and not config.matches_pattern(node["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {node['pattern']}")
    if t == "object":
        if "maxProperties" in node and len(value) > node["maxProperties"]:
            errors.append(f"{path}: {len(value)} properties, at most {node['maxProperties']} allowed")
        props, extra = node.get("properties"), node.get("additionalProperties")
        errors += [f"{path}.{name}: required" for name in node.get("required", []) if name not in value]
        for name, sub in value.items():
            if props and name in props:
                errors += schema_errors(sub, props[name], f"{path}.{name}")
            elif isinstance(extra, dict):
                errors += schema_errors(sub, extra, f"{path}.{name}")
            elif props is not None and not node.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{name}: unknown field")
    if t == "array" and "items" in node:
        for i, item in enumerate(value):
            errors += schema_errors(item, node["items"], f"{path}[{i}]")
    return errors
