"""Example pools (``examples/*.yaml``) as bodies, the way the API server hands them to the operator."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = pathlib.Path(__file__).with_name("golden")
NAMES = ("cpu-demo", "gpu-1p1d", "gpu-2p4d-external-redis")


def example_body(name: str, uid: str = "5f0e2b1c-0000-4000-8000-000000000001", generation: int = 1) -> dict:
    body = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    body["metadata"].setdefault("namespace", "default")
    body["metadata"].update(uid=uid, generation=generation)
    return body


def make_body(spec: dict, name: str = "p", namespace: str = "default") -> dict:
    return {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace, "uid": "u-1", "generation": 1}, "spec": spec}


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against pod labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def admits(policy: dict, source: dict, target: dict, port: int) -> bool:
    """Whether an Ingress NetworkPolicy lets a pod labelled ``source`` (same namespace) reach a pod labelled
    ``target`` on TCP ``port``; a target the policy does not select is not restricted by it (and False here)."""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], target):
        return False
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        peers = rule.get("from")
        if not peers or any("podSelector" in peer and "namespaceSelector" not in peer
                            and _selects(peer["podSelector"], source) for peer in peers):
            return True
    return False
