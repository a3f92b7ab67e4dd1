"""Hand edits to a pool's children are undone, and what the API server itself does to them is not a difference.

The operator compares the fields it sets with the stored child (``reconcile.carries``), not only the hash annotation
of what it last applied: ``kubectl set image`` or ``kubectl edit`` leave that annotation as it was. The API server
adds defaults, leaves out zero values and canonicalises quantities (``0.5`` → ``500m``, ``1024Mi`` → ``1Gi``, an
integer GPU count → ``"1"``); none of that may make the operator patch again (a rollout on every status tick).
"""

from __future__ import annotations

import copy
import time

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import given

from k8s_emulator import defaults
from k8s_emulator.resources import Registry
from operator_examples import NAMES, example_body
from operator_procs import wait_until
from pdpool.operator import builders
from pdpool.operator.reconcile import carries, drifted
from pdpool.operator.spec import parse_pool

POOL = "inferencepools.pdpool.io"
CHILD_KINDS = {"deployments", "services", "configmaps", "secrets", "networkpolicies"}
RESOURCES = {"requests": {"cpu": "0.5", "memory": "1024Mi"}, "limits": {"cpu": 1, "memory": "2048Mi"}}


def stored(obj: dict) -> dict:
    """``obj`` as the emulated API server keeps it after its defaulting."""
    out = copy.deepcopy(obj)
    defaults.apply(Registry().by_kind(obj["apiVersion"], obj["kind"]), out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_api_servers_defaults_are_no_drift(name):
    body = example_body(name)
    resources = body["spec"]["decode"].setdefault("resources", {})
    resources["requests"] = RESOURCES["requests"]
    resources.setdefault("limits", RESOURCES["limits"])
    for obj in builders.render(parse_pool(body), token=lambda: "t"):
        assert not drifted(obj, stored(obj)), obj["metadata"]["name"]


quantities = st.one_of(
    st.integers(0, 10 ** 6),
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(0, 10 ** 6),
              st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti"])),
    st.builds(lambda a, b: f"{a}.{b}", st.integers(0, 999), st.integers(0, 999)))


@given(quantities)
def test_a_canonicalised_quantity_is_the_same_quantity(value):
    assert carries({"limits": {"cpu": value}}, {"limits": {"cpu": defaults.canonical_quantity(value)}}, "resources")


def test_a_quantity_changed_by_hand_and_values_outside_resources_are_compared_exactly():
    assert not carries({"limits": {"cpu": "1"}}, {"limits": {"cpu": "2"}}, "resources")
    assert not carries({"args": ["--max-num-seqs", "4"]}, {"args": ["--max-num-seqs", "4000m"]})
    assert carries({"readOnly": False, "value": ""}, {})  # zero values the API server leaves out
    assert not carries({"readOnly": True}, {})
    # a pointer's false is stored: removing it by hand (the token then mounted) is a difference
    assert not carries({"automountServiceAccountToken": False}, {})


def get(cluster, kind: str, name: str) -> dict:
    return cluster.kubectl.json("get", kind, name)


def operator_child_writes(cluster) -> set[tuple[str, str]]:
    return {(w["resource"], w["name"]) for w in cluster.writes() if w.get("resource") in CHILD_KINDS}


def test_hand_edits_are_undone_and_only_the_edited_child_is_written(cluster, plain_operator, tmp_path):
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "drift"},
            "spec": {"decode": {"replicas": 1, "resources": RESOURCES}}}
    path = tmp_path / "drift.yaml"
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    decode = wait_until(lambda: get(cluster, "deployment", "drift-decode"), what="drift-decode")
    (container,) = decode["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}  # as a real API server stores it
    image = container["image"]
    wait_until(lambda: get(cluster, POOL, "drift").get("status", {}).get("observedGeneration") == 1,
               what="generation 1 applied")
    time.sleep(0.5)
    cluster.clear_writes()
    time.sleep(1.5)  # five status ticks: nothing to repair in what the API server defaulted
    assert operator_child_writes(cluster) == set()

    cluster.kubectl("set", "image", "deployment/drift-decode", "node=example.com/other:1")
    cluster.kubectl("patch", "service", "drift-prefill", "--type=merge",
                    "-p", '{"spec": {"ports": [{"name": "http", "port": 9999, "targetPort": "http"}]}}')
    cluster.kubectl("patch", "configmap", "drift-config", "--type=merge", "-p", '{"data": {"HF_HUB_OFFLINE": "0"}}')
    cluster.kubectl("patch", "networkpolicy", "drift-nodes", "--type=json",
                    "-p", '[{"op": "remove", "path": "/spec/ingress/0"}]')
    cluster.kubectl("delete", "service", "drift-decode")
    wait_until(lambda: get(cluster, "deployment", "drift-decode")["spec"]["template"]["spec"]["containers"][0]
               ["image"] == image, timeout=10, what="the image restored")
    wait_until(lambda: get(cluster, "service", "drift-prefill")["spec"]["ports"][0]["port"] == 8000, timeout=10,
               what="the port restored")
    wait_until(lambda: get(cluster, "configmap", "drift-config")["data"]["HF_HUB_OFFLINE"] == "1", timeout=10,
               what="the ConfigMap restored")
    wait_until(lambda: len(get(cluster, "networkpolicy", "drift-nodes")["spec"]["ingress"]) == 2, timeout=10,
               what="the NetworkPolicy restored")
    wait_until(lambda: get(cluster, "service", "drift-decode"), timeout=10, what="the deleted Service recreated")
    time.sleep(1.0)
    assert operator_child_writes(cluster) == {("deployments", "drift-decode"), ("services", "drift-prefill"),
                                              ("configmaps", "drift-config"), ("networkpolicies", "drift-nodes"),
                                              ("services", "drift-decode")}
    assert get(cluster, "deployment", "drift-prefill")["metadata"]["generation"] == 1, "no other Deployment rolled"
    events = [e for e in cluster.kubectl.json("get", "events")["items"] if e["involvedObject"].get("name") == "drift"]
    assert {e["reason"] for e in events} >= {"Created", "Repaired"}, events
    assert any("Deployment/drift-decode" in e["message"] for e in events if e["reason"] == "Repaired"), events
    cluster.kubectl("patch", POOL, "drift", "--type=merge", "-p", '{"spec": {"decode": {"replicas": 2}}}')
    described = wait_until(lambda: (out := cluster.kubectl("describe", POOL, "drift").stdout) and
                           "updated Deployment/drift-decode" in out and out, timeout=10, what="an Updated event")
    assert "Repaired" in described and "Created" in described, described
    cluster.kubectl("delete", POOL, "drift", "--timeout=20s")
