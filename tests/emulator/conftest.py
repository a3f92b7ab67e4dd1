import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k8s_fixtures import k8s, k8s_module, kubeconfig, kubectl  # noqa: E402,F401
