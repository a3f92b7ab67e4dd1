"""Chart tests: real Helm 4 (helm lint, helm template) and kubectl, from tests/k8s_tools.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests/ folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # operator_examples, operator_procs
from k8s_fixtures import k8s, kubeconfig, kubectl  # noqa: E402,F401
