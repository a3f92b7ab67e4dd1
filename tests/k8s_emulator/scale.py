"""The `scale` subresource (autoscaling/v1 Scale) of workloads and of CRDs that declare one."""

from __future__ import annotations

from . import patching
from .errors import ApiError, conflict
from .tables import json_path



def _selector(rt, obj: dict) -> str | None:
    if rt.scale.get("labelSelectorPath"):
        return json_path(obj, rt.scale["labelSelectorPath"])
    labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None


def view(rt, obj: dict) -> dict:
    meta = obj["metadata"]
    status = {"replicas": json_path(obj, rt.scale.get("statusReplicasPath") or ".status.replicas") or 0}
    if selector := _selector(rt, obj):
        status["selector"] = selector
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": json_path(obj, rt.scale["specReplicasPath"]) or 0}, "status": status}


def write(api, rt, namespace: str | None, name: str, body, content_type: str | None) -> dict:
    """PUT (content_type None) or PATCH a Scale; changes only the object's replica count."""
    with api.store.lock:
        obj = api.get(rt, namespace, name)
        current = view(rt, obj)
        if content_type is None:
            new = body
        elif content_type == patching.JSON_PATCH:
            new = patching.json_patch(current, body)
        else:
            new = patching.merge_patch(current, body)
        wanted = (new.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != obj["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        replicas = (new.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, f"Scale.autoscaling \"{name}\" is invalid: spec.replicas: Invalid value: "
                                f"{replicas}: must be greater than or equal to 0", reason="Invalid")
        target = obj
        *parents, leaf = rt.scale["specReplicasPath"].strip(".").split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = replicas
        return view(rt, api.update(rt, namespace, name, obj))
