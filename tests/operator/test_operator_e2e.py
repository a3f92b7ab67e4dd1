"""End to end: real kopf (``pdpool operator`` subprocesses), real kubectl 1.35 with default flags, the
in-memory Kubernetes API emulator, and a real redis-server. The tests run in file order on one emulator.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
import redis
import yaml

from operator_examples import EXAMPLES, ROOT
from operator_procs import OperatorProcess, wait_until
from pdpool import config
from pdpool.kv_index.keys import key_prefix
from pdpool.operator import crd
from pdpool.router import settings

POOL = "inferencepools.pdpool.io"
CHILD_KINDS = {"deployments", "services", "configmaps", "secrets", "networkpolicies"}
LEASE_SECONDS = 2.0


@pytest.fixture(scope="module")
def operator(cluster, redis_server, tmp_path_factory):
    """One operator (its process may be replaced by a test); stopped at the end of the module."""
    log_dir = tmp_path_factory.mktemp("operator-logs")
    cluster.kubectl("apply", "-f", str(ROOT / "operator" / "crd.yaml"))
    holder = {"log_dir": log_dir}

    def start(identity: str = "op-1", lease_seconds: float = LEASE_SECONDS) -> OperatorProcess:
        proc = OperatorProcess(cluster.kubeconfig, log_dir, identity, "--managed-redis-url", redis_server.url,
                               lease_seconds=lease_seconds)
        holder.setdefault("procs", []).append(proc)
        return proc

    holder["start"] = start
    holder["current"] = start()
    yield holder
    for proc in holder["procs"]:
        proc.stop()


def child_writes(cluster) -> list[dict]:
    return [w for w in cluster.writes() if w.get("resource") in CHILD_KINDS]


def get(cluster, kind: str, name: str) -> dict:
    return cluster.kubectl.json("get", kind, name)


def condition(pool: dict, type_: str) -> dict:
    return next((c for c in (pool.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def set_rolled_out(cluster, names=("demo-prefill", "demo-decode", "demo-router", "demo-redis")) -> None:
    """Play the Deployment controller: every replica updated and ready at the current generation."""
    for name in names:
        dep = get(cluster, "deployment", name)
        n = dep["spec"].get("replicas", 1)
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                  "readyReplicas": n, "availableReplicas": n}
        cluster.kubectl("patch", "deployment", name, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": status}))


def wait_condition(cluster, name: str, type_: str, status: str, timeout: float = 20.0) -> dict:
    def check():
        pool = get(cluster, POOL, name)
        return pool if condition(pool, type_).get("status") == status else None
    return wait_until(check, timeout, what=f"{name}: {type_}={status}")


def wait_ready(cluster, status: str = "True", timeout: float = 20.0) -> dict:
    return wait_condition(cluster, "demo", "Ready", status, timeout)


def test_apply_pool_creates_owned_children(cluster, operator):
    cluster.kubectl("apply", "-f", str(EXAMPLES / "cpu-demo.yaml"))
    pool = get(cluster, POOL, "demo")
    names = ["demo-prefill", "demo-decode", "demo-router", "demo-redis"]
    wait_until(lambda: all(cluster.kubectl("get", "deployment", n, check=False).returncode == 0 for n in names),
               what="child Deployments")
    children = cluster.kubectl.json("get", "deployments,services,configmaps,secrets,networkpolicies",
                                    "-l", "app.kubernetes.io/instance=demo")["items"]
    assert {f"{c['kind']}/{c['metadata']['name']}" for c in children} >= {
        "Deployment/demo-prefill", "Deployment/demo-decode", "Deployment/demo-router", "Deployment/demo-redis",
        "Service/demo", "Service/demo-redis", "ConfigMap/demo-config", "Secret/demo-internal", "Secret/demo-redis",
        "NetworkPolicy/demo-nodes", "NetworkPolicy/demo-redis"}
    for child in children:
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("InferencePool", "demo", pool["metadata"]["uid"])
    assert "pdpool.io/redis-keys" in get(cluster, POOL, "demo")["metadata"]["finalizers"]


def test_every_example_passes_the_api_servers_schema(cluster, operator):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}}))
    for example in sorted(EXAMPLES.glob("*.yaml")):
        out = cluster.kubectl("apply", "--dry-run=server", "-f", str(example))
        assert "(server dry run)" in out.stdout, out.stdout


def test_ready_with_printer_columns(cluster, operator):
    pool = wait_until(lambda: (p := get(cluster, POOL, "demo")).get("status", {}).get("phase") and p,
                      what="a first status")
    assert condition(pool, "Ready")["status"] == "False"
    set_rolled_out(cluster)
    pool = wait_ready(cluster)
    assert pool["status"]["observedGeneration"] == pool["metadata"]["generation"]
    assert pool["status"]["endpoint"] == "http://demo.default.svc:80"
    header, row = cluster.kubectl("get", POOL, "demo").stdout.splitlines()
    assert header.split() == ["NAME", "MODEL", "PREFILL", "DECODE", "ROUTER", "READY", "AGE"]
    assert row.split()[:6] == ["demo", "demo", "1/1", "1/1", "1/1", "True"]


def test_reapply_writes_no_child(cluster, operator):
    cluster.clear_writes()
    cluster.kubectl("apply", "-f", str(EXAMPLES / "cpu-demo.yaml"))
    time.sleep(2.0)  # several status intervals and any resync
    assert child_writes(cluster) == []
    pool_status_writes = [w for w in cluster.writes() if w.get("resource") == "inferencepools"]
    assert pool_status_writes == [], "an unchanged pool must not get its status rewritten"


def test_scaling_decode_patches_only_the_decode_deployment(cluster, operator):
    cluster.clear_writes()
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", '{"spec": {"decode": {"replicas": 2}}}')
    wait_until(lambda: get(cluster, "deployment", "demo-decode")["spec"]["replicas"] == 2, what="decode scaled")
    time.sleep(1.0)
    assert {(w["resource"], w["name"]) for w in child_writes(cluster)} == {("deployments", "demo-decode")}
    pool = wait_ready(cluster, "False")
    assert pool["status"]["replicas"]["decode"]["desired"] == 2
    set_rolled_out(cluster, ["demo-decode"])
    wait_ready(cluster)


def test_image_change_is_not_ready_until_rolled_out(cluster, operator):
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", '{"spec": {"image": "ghcr.io/pdpool/pdpool:0.1.1"}}')
    wait_until(lambda: get(cluster, "deployment", "demo-decode")["spec"]["template"]["spec"]["containers"][0]
               ["image"].endswith("0.1.1"), what="new image")
    pool = wait_ready(cluster, "False")
    # the controller has not caught up: an old generation observed
    dep = get(cluster, "deployment", "demo-prefill")
    assert dep["status"]["observedGeneration"] < dep["metadata"]["generation"]
    time.sleep(1.0)
    assert condition(get(cluster, POOL, "demo"), "Ready")["status"] == "False"
    assert condition(pool, "Progressing")["status"] == "True"
    # caught up, but only half of the replicas updated: still not Ready
    n = get(cluster, "deployment", "demo-decode")
    cluster.kubectl("patch", "deployment", "demo-decode", "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"observedGeneration": n["metadata"]["generation"], "updatedReplicas": 1, "replicas": 2}}))
    set_rolled_out(cluster, ["demo-prefill", "demo-router"])
    time.sleep(1.0)
    assert condition(get(cluster, POOL, "demo"), "Ready")["status"] == "False"
    set_rolled_out(cluster, ["demo-decode"])
    pool = wait_ready(cluster)
    assert condition(pool, "Progressing")["status"] == "False"


def test_restart_writes_no_child(cluster, operator):
    password = get(cluster, "secret", "demo-redis")["data"]["password"]
    assert operator["current"].stop() == 0
    cluster.clear_writes()
    operator["current"] = operator["start"]("op-2")
    wait_until(lambda: get(cluster, "lease", "pdpool-operator")["spec"].get("holderIdentity") == "op-2",
               what="op-2 leads")
    wait_until(lambda: "resum" in operator["current"].log().lower() or "succeeded" in operator["current"].log(),
               timeout=10, what="resume handler ran")
    time.sleep(2.0)
    assert child_writes(cluster) == []
    assert [w for w in cluster.writes() if w["resource"] == "inferencepools"] == []
    assert condition(get(cluster, POOL, "demo"), "Ready")["status"] == "True"
    assert get(cluster, "secret", "demo-redis")["data"]["password"] == password, "generated once, never rotated"


def test_an_autoscaled_role_is_never_fought(cluster, operator, tmp_path):
    body = yaml.safe_load((EXAMPLES / "cpu-demo.yaml").read_text())
    body["metadata"]["name"] = "hpa"
    del body["spec"]["decode"]["replicas"]  # an HPA owns decode
    body["spec"].get("router", {}).pop("replicas", None)  # and one the router (the CRD defaulted it to 1: fought)
    path = tmp_path / "hpa.yaml"
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    wait_until(lambda: get(cluster, "deployment", "hpa-decode"), what="hpa-decode")
    # as an HPA would (the emulator has no /scale subresource, so through the Deployment itself)
    scale = lambda name, n: cluster.kubectl("patch", "deployment", name, "--type=merge",  # noqa: E731
                                            "-p", json.dumps({"spec": {"replicas": n}}))
    assert "replicas" not in get(cluster, POOL, "hpa")["spec"]["router"]
    scale("hpa-decode", 5)
    scale("hpa-router", 4)
    scale("hpa-prefill", 3)  # replicas the pool owns
    wait_until(lambda: get(cluster, "deployment", "hpa-prefill")["spec"]["replicas"] == 1, timeout=10,
               what="the pool's prefill replicas restored")
    cluster.kubectl("patch", POOL, "hpa", "--type=merge", "-p", '{"spec": {"engine": {"maxNumSeqs": 4}}}')
    wait_until(lambda: "4" in get(cluster, "deployment", "hpa-decode")["spec"]["template"]["spec"]
               ["containers"][0]["args"], what="decode re-rendered")
    assert get(cluster, "deployment", "hpa-decode")["spec"]["replicas"] == 5
    assert get(cluster, "deployment", "hpa-router")["spec"]["replicas"] == 4
    cluster.kubectl("delete", POOL, "hpa", "--timeout=20s")


def test_invalid_pool_is_rejected_by_the_schema(cluster, operator, tmp_path):
    bad = yaml.safe_load((EXAMPLES / "cpu-demo.yaml").read_text())
    bad["metadata"]["name"] = "bad"
    bad["spec"]["engine"]["maxNumSeqs"] = 0
    bad["spec"]["engine"]["device"] = "tpu"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = cluster.kubectl("apply", "-f", str(path), check=False)
    assert out.returncode != 0
    assert "maxNumSeqs" in out.stderr and "device" in out.stderr, out.stderr
    assert cluster.kubectl("get", POOL, "bad", check=False).returncode != 0


def test_two_model_sources_are_refused_by_the_schema(cluster, operator, tmp_path):
    """model.source takes one of pvc, hostPath, objectStore, image. Before, a pool setting two was stored and only
    then marked Degraded (InvalidSpec); the schema's maxProperties refuses it at kubectl apply, as pdpool up's
    check of a pool file does."""
    spec = {"model": {"name": "/models/m", "source": {"pvc": {"claimName": "weights"},
                                                       "hostPath": {"path": "/data/m"}}}}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool",
                                    "metadata": {"name": "two-sources"}, "spec": spec}))
    out = cluster.kubectl("apply", "-f", str(path), check=False)
    assert out.returncode != 0 and "spec.model.source: Too many: 2: must have at most 1 items" in out.stderr, \
        out.stderr
    assert cluster.kubectl("get", POOL, "two-sources", check=False).returncode != 0
    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert crd.schema_errors(spec, root, "spec") == ["spec.model.source: 2 properties, at most 1 allowed"]


def test_a_pool_name_its_services_cannot_carry_is_refused(cluster, operator, tmp_path):
    """Its Services are <pool>, <pool>-prefill, ...: DNS-1035 labels of at most 63 characters. Before, such a pool
    was accepted and the operator failed on its Services forever, the status saying only 'not applied yet'."""
    def apply(name: str):
        path = tmp_path / "named.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool",
                                        "metadata": {"name": name}, "spec": {}}))
        return cluster.kubectl("apply", "-f", str(path), check=False)

    too_long = apply("p" * 56)
    assert too_long.returncode != 0 and "metadata.name: Too long: may not be more than 55" in too_long.stderr
    digit = apply("7b-pool")
    assert digit.returncode != 0 and "metadata.name in body should match" in digit.stderr
    dotted = apply("my.pool")
    assert dotted.returncode != 0 and "metadata.name in body should match" in dotted.stderr
    longest = "p" * 55
    assert apply(longest).returncode == 0
    wait_until(lambda: all(cluster.kubectl("get", "service", f"{longest}{suffix}", check=False).returncode == 0
                           for suffix in ("", "-prefill", "-decode", "-redis")), what="the longest name's Services")
    cluster.kubectl("delete", POOL, longest, "--timeout=20s")


def test_a_spec_the_schema_cannot_catch_is_degraded_with_an_event(cluster, operator, tmp_path):
    gpu = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "nogpu"},
           "spec": {"engine": {"device": "cuda"}}}
    path = tmp_path / "nogpu.yaml"
    path.write_text(yaml.safe_dump(gpu))
    cluster.kubectl("apply", "-f", str(path))
    pool = wait_condition(cluster, "nogpu", "Degraded", "True")
    assert condition(pool, "Degraded")["reason"] == "InvalidSpec"
    assert "nvidia.com/gpu" in condition(pool, "Degraded")["message"]
    assert pool["status"]["phase"] == "Degraded"
    events = wait_until(lambda: [e for e in cluster.kubectl.json("get", "events")["items"]
                                 if e["involvedObject"].get("name") == "nogpu" and e["reason"] == "InvalidSpec"],
                        what="InvalidSpec event")
    assert "nvidia.com/gpu" in events[0]["message"]
    assert cluster.kubectl("get", "deployment", "nogpu-decode", check=False).returncode != 0
    cluster.kubectl("delete", POOL, "nogpu", "--timeout=20s")


def test_a_child_the_api_server_refuses_is_degraded_with_its_message(cluster, operator, tmp_path):
    """scrapeFrom peers are free-form in the CRD; a malformed one makes the API server refuse the NetworkPolicy.
    Before, the operator retried every 5 s and the status said only 'generation 1 is not applied yet'."""
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "peers"},
            "spec": {"networkPolicy": {"scrapeFrom": [{"ipBlock": "10.0.0.0/8"}]}}}
    path = tmp_path / "peers.yaml"
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    pool = wait_condition(cluster, "peers", "Degraded", "True")
    degraded = condition(pool, "Degraded")
    assert degraded["reason"] == "ChildRejected" and "NetworkPolicy" in degraded["message"], degraded
    assert "ipBlock" in degraded["message"], degraded
    wait_until(lambda: [e for e in cluster.kubectl.json("get", "events")["items"]
                        if e["involvedObject"].get("name") == "peers" and e["reason"] == "ChildRejected"],
               what="ChildRejected event")
    body["spec"]["networkPolicy"]["scrapeFrom"] = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    wait_until(lambda: get(cluster, "networkpolicy", "peers-nodes")["spec"]["ingress"][-1]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/8"}}], timeout=30, what="the fixed NetworkPolicy")
    pool = wait_condition(cluster, "peers", "Degraded", "False")
    assert pool["status"]["observedGeneration"] == pool["metadata"]["generation"]
    cluster.kubectl("delete", POOL, "peers", "--timeout=20s")


def test_a_missing_secret_is_reported_until_it_exists(cluster, operator, tmp_path):
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "keyed"},
            "spec": {"router": {"apiKeySecretRef": {"name": "keyed-api-key"}}}}
    path = tmp_path / "keyed.yaml"
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    pool = wait_condition(cluster, "keyed", "Degraded", "True")
    assert condition(pool, "Degraded")["reason"] == "SecretMissing"
    assert "keyed-api-key (key api-key)" in condition(pool, "Degraded")["message"]
    # children are created anyway (their pods wait); the status timer may report the Secret before they exist
    wait_until(lambda: get(cluster, "deployment", "keyed-router"), what="children created anyway")
    # (`kubectl create secret` sends protobuf, which the emulator does not decode; apply sends JSON)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keyed-api-key"},
              "stringData": {"api-key": "s3cret"}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
    wait_condition(cluster, "keyed", "Degraded", "False")
    cluster.kubectl("delete", POOL, "keyed", "--timeout=20s")


def test_missing_object_store_credentials_are_reported_until_they_exist(cluster, operator):
    """model.source.objectStore.credentialsSecretRef is every node's and the router's init container's envFrom:
    without it no pod starts (CreateContainerConfigError). Before, the pool said only 'not ready: prefill (0/1
    ready)', as for a slow start; now SecretMissing names it, as for the API key."""
    store = {"uri": "s3://models/m", "credentialsSecretRef": {"name": "s3-creds"}}
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "s3"},
            "spec": {"model": {"name": "/models/m", "source": {"objectStore": store}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    pool = wait_condition(cluster, "s3", "Degraded", "True")
    assert condition(pool, "Degraded")["reason"] == "SecretMissing"
    assert "waiting for Secret s3-creds in default" in condition(pool, "Degraded")["message"], condition(pool,
                                                                                                      "Degraded")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
              "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key"}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
    wait_condition(cluster, "s3", "Degraded", "False")
    cluster.kubectl("delete", POOL, "s3", "--timeout=20s")


def test_kubernetes_discovery_and_changed_children_are_patched(cluster, operator):
    """router.discovery: kubernetes adds the router's ServiceAccount, Role and RoleBinding; a changed ConfigMap,
    NetworkPolicy and Service are patched; RBAC children rendered differently (an operator upgrade) are too."""
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", json.dumps({"spec": {
        "router": {"discovery": "kubernetes", "service": {"port": 8080}},
        "kvTransfer": {"ucxNetDevices": "eth0"}, "networkPolicy": {"scrapeFrom": [peer]}}}))
    router = wait_until(lambda: (d := get(cluster, "deployment", "demo-router"))["spec"]["template"]["spec"]
                        .get("serviceAccountName") == "demo-router" and d, what="router with a service account")
    pod = router["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True and "--kubernetes" in pod["containers"][0]["args"]
    role = get(cluster, "role", "demo-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert get(cluster, "rolebinding", "demo-router")["roleRef"]["name"] == "demo-router"
    assert get(cluster, "serviceaccount", "demo-router")
    assert get(cluster, "configmap", "demo-config")["data"]["UCX_NET_DEVICES"] == "eth0"
    assert get(cluster, "service", "demo")["spec"]["ports"][0]["port"] == 8080
    assert get(cluster, "networkpolicy", "demo-nodes")["spec"]["ingress"][-1]["from"] == [peer]
    cluster.clear_writes()
    for kind in ("serviceaccount", "role", "rolebinding"):  # as if an older operator had rendered them
        cluster.kubectl("annotate", "--overwrite", kind, "demo-router", "pdpool.io/spec-hash=0000000000000000")
    wait_until(lambda: {(w["resource"], w["method"]) for w in cluster.writes()} >= {
        ("serviceaccounts", "PATCH"), ("roles", "PATCH"), ("rolebindings", "PATCH")}, what="drift repaired")
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", json.dumps({"spec": {
        "router": {"discovery": "redis", "service": {"port": 80}}}}))
    wait_until(lambda: "serviceAccountName" not in get(cluster, "deployment", "demo-router")["spec"]["template"]
               ["spec"], what="router back on Redis discovery")
    assert get(cluster, "deployment", "demo-router")["spec"]["template"]["spec"]["automountServiceAccountToken"] \
        is False
    # the router's RBAC goes with it (nothing left behind that only another spec needed)
    for kind in ("serviceaccount", "role", "rolebinding"):
        wait_until(lambda: cluster.kubectl("get", kind, "demo-router", check=False).returncode != 0,
                   what=f"{kind} demo-router deleted")


def test_image_pull_secrets_reach_every_pod_and_go_when_removed(cluster, operator):
    deployments = ("demo-prefill", "demo-decode", "demo-router", "demo-redis")

    def pull_secrets() -> list:
        return [get(cluster, "deployment", n)["spec"]["template"]["spec"].get("imagePullSecrets") for n in deployments]

    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p",
                    json.dumps({"spec": {"imagePullSecrets": [{"name": "ghcr-pull"}]}}))
    wait_until(lambda: pull_secrets() == [[{"name": "ghcr-pull"}]] * 4, what="pull secrets on every Deployment")
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", '{"spec": {"imagePullSecrets": null}}')
    wait_until(lambda: pull_secrets() == [None] * 4, what="pull secrets removed from every Deployment")


def test_cors_reaches_the_router_and_the_nodes_and_goes_when_removed(cluster, operator):
    """The spec's cors section becomes the CORS flags of the router (what a browser's page calls) and of both node
    Deployments, as `pdpool router` and `pdpool serve` parse them; the API server refuses a string where a list
    belongs; without the section the defaults (any origin) apply and no flag is written."""
    flags = {"--allowed-origins", "--allow-credentials", "--allowed-methods", "--allowed-headers"}
    names = ("demo-prefill", "demo-decode", "demo-router")

    def args() -> dict[str, list[str]]:
        return {n: get(cluster, "deployment", n)["spec"]["template"]["spec"]["containers"][0]["args"] for n in names}

    cors = {"allowedOrigins": ["https://app.example"], "allowCredentials": True, "allowedMethods": ["GET", "POST"],
            "allowedHeaders": []}
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", json.dumps({"spec": {"cors": cors}}))
    def all_flagged() -> dict[str, list[str]] | None:
        now = args()
        return now if all(flags <= set(v) for v in now.values()) else None

    got = wait_until(all_flagged, what="CORS flags on the router and the nodes")
    router, _ = settings.load(got["demo-router"][1:], environ={})
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    for section in [router.router] + [config.from_args(parser.parse_args(got[n][1:]), environ={}).server
                                      for n in ("demo-prefill", "demo-decode")]:
        assert (section.allowed_origins, section.allow_credentials, section.allowed_methods,
                section.allowed_headers) == (["https://app.example"], True, ["GET", "POST"], [])
    refused = cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p",
                              '{"spec": {"cors": {"allowedOrigins": "https://app.example"}}}', check=False)
    assert refused.returncode != 0 and "allowedOrigins" in refused.stderr, refused.stderr
    refused = cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p",   # no header can carry it: the CRD's pattern
                              json.dumps({"spec": {"cors": {"allowedOrigins": ["https://caf\u00e9.example"]}}}),
                              check=False)
    assert refused.returncode != 0 and "allowedOrigins" in refused.stderr, refused.stderr
    cluster.kubectl("patch", POOL, "demo", "--type=merge", "-p", '{"spec": {"cors": null}}')
    wait_until(lambda: not any(flags & set(v) for v in args().values()), what="CORS flags gone")
    assert get(cluster, POOL, "demo")["spec"]["cors"]["allowedOrigins"] == ["*"]   # the CRD's default


def test_moving_to_an_external_redis_deletes_the_managed_one(cluster, operator, redis_server, tmp_path):
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "moving"}, "spec": {}}
    path = tmp_path / "moving.yaml"
    path.write_text(yaml.safe_dump(body))
    cluster.kubectl("apply", "-f", str(path))
    managed = ["deployment/moving-redis", "service/moving-redis", "networkpolicy/moving-redis", "secret/moving-redis"]
    wait_until(lambda: all(cluster.kubectl("get", m, check=False).returncode == 0 for m in managed),
               what="the managed Redis")
    cluster.kubectl("patch", POOL, "moving", "--type=merge", "-p",
                    json.dumps({"spec": {"redis": {"url": redis_server.url}}}))
    wait_until(lambda: all(cluster.kubectl("get", m, check=False).returncode != 0 for m in managed),
               what="the managed Redis deleted")
    for role in ("prefill", "decode", "router"):
        (c,) = get(cluster, "deployment", f"moving-{role}")["spec"]["template"]["spec"]["containers"]
        assert redis_server.url in c["args"], role
        assert "PDPOOL_REDIS_PASSWORD" not in {e["name"] for e in c["env"]}, role
    assert "redis" not in get(cluster, POOL, "moving")["status"]["replicas"]
    cluster.kubectl("delete", POOL, "moving", "--timeout=20s")


def test_a_pool_deleted_with_cascade_orphan_and_applied_again_adopts_its_children(cluster, operator):
    """``kubectl delete --cascade=orphan`` keeps a pool's children running without owner; applying the pool again
    takes them back, as a Deployment adopts its orphaned ReplicaSets: nothing restarts, the generated token stays.
    Before, the new pool was Degraded (ChildConflict, 'created outside any pool') until every child was deleted
    by hand. The operator reads the pool again before adopting (as Kubernetes' controllers do): a status tick that
    runs while the orphaning deletion is under way must not hand the children back to the pool being deleted."""
    body = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "orph"}, "spec": {}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    names = ("orph-prefill", "orph-decode", "orph-router", "orph-redis")
    wait_until(lambda: all(cluster.kubectl("get", "deployment", n, check=False).returncode == 0 for n in names),
               what="the Deployments")
    generation = {n: get(cluster, "deployment", n)["metadata"]["generation"] for n in names}
    token = get(cluster, "secret", "orph-internal")["data"]["token"]
    cluster.kubectl("delete", POOL, "orph", "--cascade=orphan", "--timeout=20s")
    time.sleep(1.0)  # status ticks of the deleted pool, if any, come and go
    assert not get(cluster, "deployment", "orph-decode")["metadata"].get("ownerReferences")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    uid = get(cluster, POOL, "orph")["metadata"]["uid"]
    owners = lambda kind, name: [r["uid"] for r in  # noqa: E731
                                 get(cluster, kind, name)["metadata"].get("ownerReferences") or []]
    wait_until(lambda: all(owners("deployment", n) == [uid] for n in names), what="the Deployments adopted")
    for kind, name in (("secret", "orph-internal"), ("secret", "orph-redis"), ("service", "orph"),
                       ("configmap", "orph-config"), ("networkpolicy", "orph-nodes")):
        assert owners(kind, name) == [uid], (kind, name)
    assert get(cluster, "secret", "orph-internal")["data"]["token"] == token
    assert {n: get(cluster, "deployment", n)["metadata"]["generation"] for n in names} == generation
    pool = wait_until(lambda: (p := get(cluster, POOL, "orph")).get("status", {}).get("observedGeneration") and p,
                      what="a status")
    assert condition(pool, "Degraded")["status"] == "False", condition(pool, "Degraded")
    cluster.kubectl("delete", POOL, "orph", "--timeout=20s")


def test_delete_runs_the_finalizer_on_real_redis(cluster, operator, redis_server):
    secret = get(cluster, "secret", "demo-redis")
    import base64

    password = base64.b64decode(secret["data"]["password"]).decode()
    r = redis.Redis(port=redis_server.port)
    r.config_set("requirepass", password)
    r = redis.Redis(port=redis_server.port, password=password)
    mine, other = key_prefix("default", "demo"), key_prefix("default", "other")
    for i in range(1200):
        r.set(f"{mine}block:{i}", i)
    r.set(f"{other}block:1", 1)
    cluster.kubectl("delete", POOL, "demo", "--timeout=30s")
    assert cluster.kubectl("get", POOL, "demo", check=False).returncode != 0
    assert list(r.scan_iter(match=mine + "*")) == []
    assert r.get(f"{other}block:1") == b"1"
    wait_until(lambda: cluster.kubectl("get", "deployment", "demo-decode", check=False).returncode != 0,
               what="children collected")
    r.config_set("requirepass", "")


def test_leader_election_fails_over_when_the_leader_stops(cluster, operator):
    operator["current"].stop()
    a, b = operator["start"]("op-a"), operator["start"]("op-b")
    lease = lambda: get(cluster, "lease", "pdpool-operator")["spec"]  # noqa: E731
    first = wait_until(lambda: lease().get("holderIdentity") in ("op-a", "op-b") and lease()["holderIdentity"],
                       timeout=15, what="a leader")
    leader, follower = (a, b) if first == "op-a" else (b, a)
    time.sleep(LEASE_SECONDS)
    assert lease()["holderIdentity"] == leader.identity, "the leader keeps renewing"
    assert follower.proc.poll() is None and "leading" not in follower.log()
    leader.pause()
    stopped = time.monotonic()
    wait_until(lambda: lease()["holderIdentity"] == follower.identity, timeout=LEASE_SECONDS * 3,
               interval=0.05, what="follower takes over")
    took = time.monotonic() - stopped
    assert took <= LEASE_SECONDS + LEASE_SECONDS / 5 + 1.0, f"took over after {took:.1f}s"
    # the new leader reconciles
    cluster.kubectl("apply", "-f", str(EXAMPLES / "cpu-demo.yaml"))
    wait_until(lambda: cluster.kubectl("get", "deployment", "demo-decode", check=False).returncode == 0,
               what="new leader reconciles")
    # the old leader wakes up, finds the Lease taken, and exits without writing anything
    cluster.clear_writes()
    leader.resume()
    wait_until(lambda: leader.proc.poll() is not None, timeout=10, what="old leader exits")
    assert leader.proc.returncode == 1
    assert [w for w in cluster.writes() if f"/{leader.identity}" in w.get("user_agent", "")] == []
    cluster.kubectl("delete", POOL, "demo", "--timeout=30s")
