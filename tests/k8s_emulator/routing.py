"""Which resource a request path names: group, version, namespace, plural, name, subresource."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Target:
    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse(path: str) -> Target | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest or rest[0] == "watch":
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    if len(rest) > 3:
        return None
    return Target(group, version, rest[0], namespace, *rest[1:])


def path_for(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
    """`path_for("apps/v1", "deployments", "default", "web", "status")` → the API path."""
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    parts = [base] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    parts += [p for p in (name, subresource) if p]
    return "/".join(parts)
