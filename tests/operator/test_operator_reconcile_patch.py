"""The merge patch carries only what the operator owns; removed owned fields become null."""

from __future__ import annotations

from operator_examples import example_body
from pdpool.operator import builders
from pdpool.operator.reconcile import merge_patch
from pdpool.operator.spec import parse_pool


def decode(body):
    return next(o for o in builders.render(parse_pool(body), token=lambda: "t") if o["metadata"]["name"].endswith("-decode")
                and o["kind"] == "Deployment")


def test_removed_node_selector_and_tolerations_are_nulled_and_defaults_left_alone():
    body = example_body("gpu-1p1d")
    actual = decode(body)
    actual["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"  # an API server default
    actual["spec"]["template"]["spec"]["nodeSelector"]["zone"] = "a"
    body["spec"]["decode"].pop("tolerations")
    patch = merge_patch(decode(body), actual)
    pod = patch["spec"]["template"]["spec"]
    assert pod["tolerations"] is None and pod["nodeSelector"]["zone"] is None
    assert "dnsPolicy" not in pod and "status" not in patch


def test_autoscaled_replicas_are_never_in_the_patch():
    body = example_body("gpu-1p1d")
    body["spec"]["decode"].pop("replicas")
    actual = decode(example_body("gpu-1p1d"))
    actual["spec"]["replicas"] = 7
    assert "replicas" not in merge_patch(decode(body), actual)["spec"]
