"""Operator tests: a module-scoped emulated cluster with a kubeconfig and the real kubectl."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests/ folder
from k8s_fixtures import MODULE_REQUESTS, ModuleRequests, k8s_module  # noqa: E402,F401
from k8s_tools import Kubectl, write_kubeconfig  # noqa: E402


@dataclass
class Cluster:
    emulator: object
    kubeconfig: Path
    kubectl: Kubectl

    def writes(self, **where) -> list[dict]:
        """Mutating requests, except kubectl's own (the test's)."""
        return [w for w in self.emulator.writes(**where) if not w.get("user_agent", "").startswith("kubectl")]

    def clear_writes(self) -> None:
        self.emulator.clear_writes()


@pytest.fixture(scope="module")
def cluster(k8s_module, tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("cluster")
    kubeconfig = write_kubeconfig(tmp / "kubeconfig", k8s_module.url)
    failed = request.session.testsfailed
    yield Cluster(k8s_module, kubeconfig, Kubectl(kubeconfig, tmp / "home"))
    # tests/helm/test_chart_rbac.py compares a module's requests with the chart's RBAC: it reads them here when the
    # module ran earlier in this session, or runs the module in a pytest of its own with this set
    request.config.stash.setdefault(MODULE_REQUESTS, {})[request.module.__name__] = ModuleRequests(
        k8s_module.requests(), request.session.testsfailed - failed)
    log = os.environ.get("PDPOOL_K8S_REQUEST_LOG")
    if log:
        Path(log).with_name(f"{Path(log).name}.{request.module.__name__}").write_text(
            json.dumps(k8s_module.requests()))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for the module's operators (external Redis, finalizer key cleanup)."""
    from operator_procs import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_operator(cluster, tmp_path_factory, request):
    """One ``pdpool operator`` with the default flags on the module's cluster, the CRD applied."""
    from operator_examples import ROOT
    from operator_procs import OperatorProcess

    cluster.kubectl("apply", "-f", str(ROOT / "operator" / "crd.yaml"))
    proc = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator"),
                           f"op-{request.module.__name__.rsplit('_', 1)[-1]}")
    yield proc
    proc.stop()
