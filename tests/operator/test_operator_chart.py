"""The Helm chart ships the generated CRD and renders valid Kubernetes objects."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import yaml

from operator_examples import ROOT
from pdpool.operator import crd

sys.path.insert(0, str(ROOT / "tests"))
import k8s_tools  # noqa: E402  (the shared kubectl/helm extractor)

CHART = ROOT / "charts" / "pdpool-operator"


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "inferencepools.pdpool.io.yaml").read_text() == crd.render_crd(), \
        "cp operator/crd.yaml charts/pdpool-operator/crds/inferencepools.pdpool.io.yaml"


def test_chart_renders_valid_objects():
    out = subprocess.run([str(k8s_tools.helm_path()), "template", "ops", str(CHART), "--namespace", "pdpool-system",
                          "--set", "watchNamespaces={a,b}"], capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "ServiceAccount", "ClusterRole", "Role"}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args and "--namespace=b" in args
