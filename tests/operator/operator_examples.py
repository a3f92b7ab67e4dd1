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
