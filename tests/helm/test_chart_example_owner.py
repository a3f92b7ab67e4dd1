"""The chart's example pool is a Helm hook, and Helm deletes a hook's object of the same name before it creates
the hook (``before-hook-creation``) without asking whose it is: a user's own InferencePool named like the
example would be deleted, its pods with it. The chart looks the name up at install and refuses instead.

``helm install --dry-run=server`` renders with the cluster's lookups, as a real install does, and stops before
Helm writes its release record (a protobuf Secret, which the API emulator cannot decode)."""

from __future__ import annotations

import json

import pytest

from chart import CHART, NAMESPACE, RELEASE, helm


def pool(labels: dict | None = None) -> str:
    return json.dumps({"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool",
                       "metadata": {"name": "demo", "namespace": NAMESPACE, "labels": labels or {}},
                       "spec": {"model": {"name": "mine"}, "engine": {"device": "cpu"}}})


@pytest.fixture
def cluster(kubectl):
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": NAMESPACE}}))
    crd = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--show-only", "templates/crd.yaml").stdout
    kubectl("apply", "-f", "-", input=crd)
    return kubectl


def install(kubeconfig, *values: str):
    return helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kubeconfig", str(kubeconfig),
                "--dry-run=server", "--set", "examplePool.enabled=true", "--set", "crds.install=false", *values,
                check=False)


@pytest.mark.parametrize("labels", [None, {"app.kubernetes.io/instance": "other-release",
                                           "app.kubernetes.io/managed-by": "Helm"}])
def test_installing_the_example_pool_never_replaces_a_users_pool_of_the_same_name(cluster, kubeconfig, labels):
    cluster("apply", "-f", "-", input=pool(labels))

    proc = install(kubeconfig)

    assert proc.returncode != 0
    assert f"InferencePool demo in namespace {NAMESPACE} already exists" in proc.stderr, proc.stderr
    assert "examplePool.name" in proc.stderr
    assert cluster.json("get", "inferencepool", "demo", "-n", NAMESPACE)["spec"]["model"]["name"] == "mine"


def test_the_example_pool_installs_beside_other_pools_and_replaces_only_its_own(cluster, kubeconfig):
    assert install(kubeconfig).returncode == 0                         # no pool of the name yet
    assert install(kubeconfig, "--set", "examplePool.name=demo2").returncode == 0

    cluster("apply", "-f", "-", input=pool({"app.kubernetes.io/instance": RELEASE,
                                             "app.kubernetes.io/managed-by": "Helm"}))
    proc = install(kubeconfig)                                         # this release's own example: an upgrade
    assert proc.returncode == 0, proc.stderr
    assert "kind: InferencePool" in proc.stdout
