"""Legacy discovery documents: /api, /api/v1, /apis, /apis/<group>, /apis/<group>/<version>.

The server answers plain JSON to aggregated-discovery requests; client-go then falls
back to per-group-version documents, as it does against older servers.
"""

from __future__ import annotations

from .resources import Registry, ResourceType

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def api_versions(server_address: str) -> dict:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def _group(registry: Registry, name: str, versions: list[str]) -> dict:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(registry: Registry) -> dict:
    groups = [_group(registry, g, vs) for g, vs in registry.group_versions().items() if g]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(registry: Registry, name: str) -> dict | None:
    versions = registry.group_versions().get(name)
    if not name or not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(registry, name, versions)}


def _resource(rt: ResourceType) -> list[dict]:
    main = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced, "kind": rt.kind,
            "verbs": VERBS}
    if rt.short_names:
        main["shortNames"] = rt.short_names
    if rt.categories:
        main["categories"] = rt.categories
    out = [main]
    if rt.scale:
        out.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                    "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
    if rt.status_subresource:
        out.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                    "kind": rt.kind, "verbs": ["get", "patch", "update"]})
    return out


def api_resource_list(registry: Registry, group: str, version: str) -> dict | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    resources = [r for rt in types for r in _resource(rt)]
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


# -- aggregated discovery (apidiscovery.k8s.io/v2): what kubectl 1.35 asks for first ---------------

AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def wants_aggregated(accept: str) -> bool:
    first = accept.split(",")[0].replace(" ", "")
    return "as=APIGroupDiscoveryList" in first and "v=v2;" in first + ";"


def _gvk(rt: ResourceType) -> dict:
    return {"group": rt.group, "version": rt.version, "kind": rt.kind}


def _resource_discovery(rt: ResourceType) -> dict:
    out = {"resource": rt.plural, "responseKind": _gvk(rt), "scope": "Namespaced" if rt.namespaced else "Cluster",
           "singularResource": rt.singular, "verbs": VERBS}
    if rt.short_names:
        out["shortNames"] = rt.short_names
    if rt.categories:
        out["categories"] = rt.categories
    subresources = []
    if rt.status_subresource:
        subresources.append({"subresource": "status", "responseKind": _gvk(rt), "verbs": ["get", "patch", "update"]})
    if rt.scale:
        subresources.append({"subresource": "scale", "verbs": ["get", "patch", "update"],
                             "responseKind": {"group": "autoscaling", "version": "v1", "kind": "Scale"}})
    if subresources:
        out["subresources"] = subresources
    return out


def aggregated(registry: Registry, core: bool) -> dict:
    items = []
    for group, versions in registry.group_versions().items():
        if bool(group) == core:
            continue
        items.append({"metadata": {"name": group}, "versions": [
            {"version": v, "freshness": "Current",
             "resources": [_resource_discovery(rt) for rt in registry.in_group_version(group, v)]}
            for v in versions]})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {},
            "items": items}
