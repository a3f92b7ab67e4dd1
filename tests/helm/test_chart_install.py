"""``helm template`` applied with the real kubectl to the API emulator, the operator started exactly as the
rendered Deployment says (args, env, the pool-defaults ConfigMap as its mounted file), then the chart's example
pool: it reconciles as the operator's e2e expects, with the chart's RDMA defaults on its nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import yaml

from chart import NAMESPACE, VALUE_SETS, template
from operator_procs import free_port, wait_until

POOL = "inferencepools.pdpool.io"


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def installed(k8s, kubectl, kubeconfig, tmp_path):
    docs = [d for d in yaml.safe_load_all(template(*VALUE_SETS["example-pool"], *VALUE_SETS["rdma"])) if d]
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": NAMESPACE}}))
    crd = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    rest = [d for d in docs if d["kind"] not in ("CustomResourceDefinition", "InferencePool")]
    out = kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rest))
    assert out.stdout.count("created") == len(rest), out.stdout

    # the operator, as the rendered Deployment runs it
    (dep,) = [d for d in rest if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    (cm,) = [d for d in rest if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-pool-defaults")]
    defaults = tmp_path / "pool-defaults.yaml"
    defaults.write_text(cm["data"]["pool-defaults.yaml"])
    health = free_port()
    args = []
    for arg in container["args"]:
        if arg.startswith("--pool-defaults="):
            arg = f"--pool-defaults={defaults}"
        if arg.startswith("--health-port="):
            arg = f"--health-port={health}"
        args.append(arg)
    assert container["command"] == ["pdpool", "operator"]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": "pdpool-0", "POD_NAMESPACE": NAMESPACE,
           "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "operator.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", "operator", *args, "--health-host", "127.0.0.1",
                             "--crd-wait-seconds", "0.3"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        (lease,) = [a.split("=", 1)[1] for a in args if a.startswith("--lease-name=")]
        yield {"k8s": k8s, "kubectl": kubectl, "crd": crd, "pools": pools, "health": health, "proc": proc,
               "log": tmp_path / "operator.log", "lease": lease}
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_chart_output_installs_and_the_example_pool_reconciles(installed):
    kubectl, health = installed["kubectl"], installed["health"]
    url = f"http://127.0.0.1:{health}"
    # before the CRD is served: alive, not ready, and it says why
    wait_until(lambda: http_get(url + "/healthz")[0] == 200, what="/healthz")
    status, body = http_get(url + "/readyz")
    assert status == 503 and "CRD" in body
    kubectl("apply", "-f", "-", input=json.dumps(installed["crd"][0]))
    wait_until(lambda: http_get(url + "/readyz")[0] == 200, timeout=20, what="/readyz once the CRD is served")
    wait_until(lambda: "pdpool_operator_leader 1.0" in http_get(url + "/metrics")[1], what="leading")
    lease = kubectl.json("get", "lease", installed["lease"], "-n", NAMESPACE)
    assert lease["spec"]["holderIdentity"] == "pdpool-0"

    (pool,) = installed["pools"]
    kubectl("apply", "-f", "-", input=json.dumps(pool))
    ns, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
    children = ["demo-prefill", "demo-decode", "demo-router", "demo-redis"]
    wait_until(lambda: all(kubectl("get", "deployment", c, "-n", ns, check=False).returncode == 0
                           for c in children), timeout=30, what="the example pool's Deployments")
    for child in children:  # play the Deployment controller
        dep = kubectl.json("get", "deployment", child, "-n", ns)
        n = dep["spec"].get("replicas", 1)
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                  "readyReplicas": n, "availableReplicas": n}
        kubectl("patch", "deployment", child, "-n", ns, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status}))

    def ready():
        body = kubectl.json("get", POOL, name, "-n", ns)
        conditions = {c["type"]: c["status"] for c in (body.get("status") or {}).get("conditions") or []}
        return body if conditions.get("Ready") == "True" else None
    body = wait_until(ready, timeout=30, what="the example pool Ready")
    assert body["status"]["endpoint"] == f"http://demo.{ns}.svc:80"
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]

    # the chart's rdma values reached the nodes through the pool defaults; the pool's own ucxTls won
    decode = kubectl.json("get", "deployment", "demo-decode", "-n", ns)["spec"]["template"]["spec"]
    (node,) = decode["containers"]
    assert node["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert node["resources"]["limits"]["rdma/ib"] == "1" and node["resources"]["limits"]["memory"] == "4Gi"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in node["volumeMounts"]
    assert decode["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
        "topologyKey"] == "nvidia.com/gpu.clique"
    config = kubectl.json("get", "configmap", "demo-config", "-n", ns)["data"]
    assert config["UCX_TLS"] == "tcp,self" and config["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert installed["proc"].poll() is None, installed["log"].read_text()[-3000:]

    # the cluster-wide operator's calls, as the rendered ClusterRole and leader Role allow them
    from test_chart_rbac import OPERATOR_AGENTS, allows, called, triples
    docs = [d for d in yaml.safe_load_all(template(*VALUE_SETS["example-pool"], *VALUE_SETS["rdma"])) if d]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (leader,) = [d for d in docs if d["kind"] == "Role"]
    requests = [r for r in installed["k8s"].requests() if r["user_agent"].startswith(OPERATOR_AGENTS)]
    leases = [r for r in requests if r["resource"] == "leases"]
    assert {r["namespace"] for r in leases} == {NAMESPACE}
    assert called(leases) <= triples(leader["rules"])
    assert all(allows(leader["rules"], r) for r in leases), "only the release's own Lease is read and updated"
    assert called([r for r in requests if r["resource"] != "leases"]) <= triples(cluster_role["rules"])
    assert any(r["namespace"] is None and r["verb"] == "watch" for r in requests), "a cluster-wide watch"
