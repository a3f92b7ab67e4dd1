"""Names, labels, owner references and the spec hash every child carries."""

from __future__ import annotations

import hashlib
import json

from pdpool.operator import crd
from pdpool.operator.spec import Pool

SPEC_HASH = "pdpool.io/spec-hash"
MANAGED_BY = "pdpool-operator"
ROLE_LABEL = "llm-d.ai/role"  # llm-d's role label: prefill | decode


def selector_labels(pool: Pool, component: str) -> dict:
    """The immutable part: a Deployment's selector and its Service's selector."""
    return {"app.kubernetes.io/instance": pool.name, "app.kubernetes.io/component": component}


def pool_selector(pool: Pool) -> dict:
    """Matches every pod of this pool (nodes, router, managed Redis)."""
    return {"app.kubernetes.io/instance": pool.name, "app.kubernetes.io/part-of": "pdpool"}


def labels(pool: Pool, component: str, name: str = "pdpool") -> dict:
    out = {
        "app.kubernetes.io/name": name,
        **selector_labels(pool, component),
        "app.kubernetes.io/part-of": "pdpool",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if component in ("prefill", "decode"):
        out[ROLE_LABEL] = component
    return out


def owner_reference(pool: Pool) -> dict:
    """What ``kopf.adopt`` sets: the pool controls the child, and GC deletes it with the pool."""
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": pool.name, "uid": pool.uid,
            "controller": True, "blockOwnerDeletion": True}


def metadata(pool: Pool, name: str, component: str, app: str = "pdpool") -> dict:
    return {"name": name, "namespace": pool.namespace, "labels": labels(pool, component, app),
            "ownerReferences": [owner_reference(pool)]}


def pull_secrets(pool: Pool) -> dict:
    """The pod-spec field every pod of the pool carries: nothing when unset, so unchanged pools do not roll."""
    return {"imagePullSecrets": pool.image_pull_secrets} if pool.image_pull_secrets else {}


def spec_hash(obj: dict) -> str:
    """Hash of everything the operator sets on a child (its own hash annotation excluded)."""
    meta = dict(obj["metadata"])
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != SPEC_HASH}
    canonical = json.dumps({**obj, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def with_hash(obj: dict) -> dict:
    meta = obj["metadata"]
    meta["annotations"] = {**(meta.get("annotations") or {}), SPEC_HASH: spec_hash(obj)}
    return obj
