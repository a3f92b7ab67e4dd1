"""Render charts/pdpool with the real Helm 4: value sets, and the objects by kind and name."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

import k8s_tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdpool"
RELEASE, NAMESPACE = "pdpool", "pdpool-system"

# The value sets CI renders: defaults, and one per feature.
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={serving,batch}"],
    "example-pool": ["--set", "examplePool.enabled=true"],
    "monitoring": ["--set", "monitoring.podMonitors.enabled=true", "--set", "monitoring.dashboard.enabled=true",
                   "--set-json", 'monitoring.scrapeFrom=[{"namespaceSelector": {"matchLabels": '
                                 '{"kubernetes.io/metadata.name": "monitoring"}}}]'],
    "rdma": ["--set", "rdma.enabled=true", "--set", "rdma.ucxNetDevices=mlx5_0:1",
             "--set", "rdma.topologyKey=nvidia.com/gpu.clique", "--set", "rdma.placement=required"],
    "single-replica-crds-off": ["--set", "operator.replicas=1", "--set", "crds.install=false"],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(k8s_tools.helm_path()), *args], capture_output=True, text=True, timeout=120,
                          env={"HOME": "/tmp", "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config", "HELM_DATA_HOME": "/tmp/helm-data"})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def template(*values: str, namespace: str = NAMESPACE) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", namespace, *values).stdout


class StrictLoader(yaml.SafeLoader):
    """Refuses a mapping with a key twice, as `helm install` and kubectl do ("mapping key already defined"),
    where PyYAML keeps the last one."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=True) for k, _ in node.value]
        twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if twice:
            raise yaml.constructor.ConstructorError(None, None, f"mapping key(s) {twice} defined twice",
                                                    node.start_mark)
        return super().construct_mapping(node, deep)


def render(*values: str, namespace: str = NAMESPACE) -> list[dict]:
    return [d for d in yaml.load_all(template(*values, namespace=namespace), Loader=StrictLoader) if d]


def by_key(docs: list[dict]) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}": d for d in docs}


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]
