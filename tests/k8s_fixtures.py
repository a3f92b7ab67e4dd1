"""Pytest fixtures: an emulated Kubernetes API server, a kubeconfig for it, and real kubectl.

Use from a conftest.py (tests/ must be importable):

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the tests/ folder
    from k8s_fixtures import k8s, kubeconfig, kubectl               # noqa: F401

    def test_x(k8s, kubectl):
        kubectl("apply", "-f", "crd.yaml")                   # real kubectl 1.35, default flags
        kubectl.json("get", "deployment", "web")             # parsed `-o json`
        k8s.set_status("apps/v1", "deployments", "default", "web", {"readyReplicas": 1})
        k8s.writes(resource="deployments", method="PATCH")   # the write log

`k8s` is function-scoped (a fresh cluster per test: namespaces default, kube-system,
kube-public, kube-node-lease); `k8s_module` is one cluster shared by a test module.
Watch bookmarks come every 0.5 s here (5 s by default in `Emulator`).
See `k8s_emulator/__init__.py` for the emulator's API and its limitations.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from k8s_emulator import Emulator
from k8s_tools import Kubectl, write_kubeconfig


class ModuleRequests(NamedTuple):
    """A test module's emulated cluster at the module's end: every request it saw, and how many tests failed."""

    requests: list[dict]
    failed: int


# {module name: ModuleRequests}, filled by tests/operator's ``cluster`` as each module ends (the session's stash)
MODULE_REQUESTS = pytest.StashKey[dict]()


@pytest.fixture
def k8s():
    with Emulator(bookmark_interval=0.5) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def k8s_module():
    with Emulator(bookmark_interval=0.5) as emulator:
        yield emulator


@pytest.fixture
def kubeconfig(k8s, tmp_path):
    return write_kubeconfig(tmp_path / "kubeconfig", k8s.url)


@pytest.fixture
def kubectl(kubeconfig, tmp_path):
    """`kubectl(*args, input=None, check=True)` → CompletedProcess; `kubectl.json(*args)` → parsed -o json."""
    return Kubectl(kubeconfig, tmp_path / "home")
