"""The real kubectl 1.35, default flags (validation on), against the emulator."""

import json
import subprocess

import yaml
from emulator_builders import make_deployment, make_widget, make_widget_crd

from k8s_tools import helm_path, kubectl_client_version


def as_yaml(*objects) -> str:
    return yaml.safe_dump_all(objects)


def test_kubectl_is_1_35_and_sees_the_server(kubectl):
    assert kubectl_client_version()["minor"] == "35"
    helm = subprocess.run([str(helm_path()), "version", "--short"], capture_output=True, text=True, check=True)
    assert helm.stdout.startswith("v4.")
    version = json.loads(kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["minor"] == "35"
    resources = kubectl("api-resources", "-o", "name").stdout.split()
    assert {"deployments.apps", "leases.coordination.k8s.io", "networkpolicies.networking.k8s.io"} <= set(resources)


def test_apply_get_patch_delete_a_deployment(k8s, kubectl):
    assert "deployment.apps/web created" in kubectl("apply", "-f", "-", input=as_yaml(make_deployment())).stdout
    changed = make_deployment(image="nginx:1.28", replicas=3)
    assert "configured" in kubectl("apply", "-f", "-", input=as_yaml(changed)).stdout
    obj = kubectl.json("get", "deployment", "web")
    assert obj["metadata"]["generation"] == 2
    assert obj["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx:1.28"
    assert "kubectl.kubernetes.io/last-applied-configuration" in obj["metadata"]["annotations"]
    assert [w["content_type"] for w in k8s.writes(kind="Deployment", method="PATCH")] == [
        "application/strategic-merge-patch+json"]
    kubectl("patch", "deployment", "web", "--subresource=status", "--type=merge",
            "-p", '{"status": {"readyReplicas": 3, "updatedReplicas": 3, "availableReplicas": 3}}')
    table = kubectl("get", "deployments").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert table[1].split()[:4] == ["web", "3/3", "3", "3"]
    kubectl("patch", "deployment", "web", "--type=merge", "-p", '{"spec": {"replicas": 1}}')
    assert kubectl.json("get", "deployment", "web")["spec"]["replicas"] == 1
    kubectl("scale", "deployment", "web", "--replicas=4")
    assert kubectl.json("get", "deployment", "web")["metadata"]["generation"] == 4
    waiting = kubectl("rollout", "status", "deployment/web", "--timeout=1s", check=False)
    assert waiting.returncode == 1 and "Waiting for deployment spec update to be observed" in waiting.stdout
    kubectl("patch", "deployment", "web", "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
        "observedGeneration": 4, "replicas": 4, "updatedReplicas": 4, "readyReplicas": 4, "availableReplicas": 4}}))
    assert "successfully rolled out" in kubectl("rollout", "status", "deployment/web", "--timeout=5s").stdout
    kubectl("delete", "deployment", "web")
    missing = kubectl("get", "deployment", "web", check=False)
    assert missing.returncode == 1 and 'deployments.apps "web" not found' in missing.stderr


def test_apply_other_builtins(kubectl):
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"a": "1"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"token": "x"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "np"},
         "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "lease"},
         "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "pdb"},
         "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "op"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "op"},
         "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "op"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "op"},
         "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "default"}]},
    ]
    out = kubectl("apply", "-f", "-", input=as_yaml(*objects)).stdout
    assert out.count("created") == len(objects)
    assert "svc" in kubectl("get", "services").stdout
    typo = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "typo"}, "dta": {"a": "1"}}
    rejected = kubectl("apply", "-f", "-", input=as_yaml(typo), check=False)
    assert rejected.returncode == 1 and 'unknown field "dta"' in rejected.stderr


def test_crd_and_custom_resources(kubectl):
    kubectl("apply", "-f", "-", input=as_yaml(make_widget_crd()))
    kubectl("wait", "--for=condition=Established", "crd/widgets.example.com", "--timeout=10s")
    assert "widget.example.com/w1 created" in kubectl("apply", "-f", "-", input=as_yaml(make_widget())).stdout
    assert "unchanged" in kubectl("apply", "-f", "-", input=as_yaml(make_widget())).stdout
    kubectl("patch", "widget", "w1", "--type=merge", "-p", '{"spec": {"replicas": 4}}')
    kubectl("patch", "widget", "w1", "--subresource=status", "--type=merge",
            "-p", '{"status": {"conditions": [{"type": "Ready", "status": "True"}]}}')
    lines = kubectl("get", "widgets").stdout.splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "REPLICAS", "READY"]
    assert lines[1].split() == ["w1", "tiny", "4", "True"]
    assert kubectl.json("get", "wd", "w1")["spec"]["mode"] == "fast"  # defaulted
    assert "replicas" in kubectl("explain", "widgets.spec").stdout
    kubectl("delete", "widget", "w1")
    assert kubectl("get", "widgets", "-o", "name").stdout == ""


def test_invalid_custom_resources_are_rejected(kubectl):
    kubectl("apply", "-f", "-", input=as_yaml(make_widget_crd()))
    invalid = kubectl("apply", "-f", "-", input=as_yaml(make_widget(replicas=50, mode="turbo")), check=False)
    assert invalid.returncode == 1
    assert 'The Widget "w1" is invalid' in invalid.stderr
    assert "spec.replicas: Invalid value: 50" in invalid.stderr
    assert 'spec.mode: Unsupported value: "turbo"' in invalid.stderr
    unknown = kubectl("apply", "-f", "-", input=as_yaml(make_widget(colour="red")), check=False)
    assert unknown.returncode == 1 and 'unknown field "spec.colour"' in unknown.stderr
    assert kubectl("get", "widgets", "-o", "name").stdout == ""
