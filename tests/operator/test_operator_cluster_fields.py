"""Spec fields for GPU clusters: router discovery and its RBAC, RDMA/shm, topology placement, model sources, the
startup probe, NetworkPolicy scrapers, and the operator's pool defaults."""

from __future__ import annotations

import copy
import subprocess

import kubernetes_validate
import pytest
import yaml

from operator_examples import ROOT, _selects, example_body
from pdpool.router import settings
from pdpool.operator import builders, crd
from pdpool.operator.builders.router import DISCOVERY_RULES
from pdpool.operator.main import load_pool_defaults
from pdpool.operator.reconcile import merge_patch
from pdpool.operator.spec import SpecError, parse_pool


def render(body: dict, defaults: dict | None = None) -> dict[str, dict]:
    objs = builders.render(parse_pool(body, defaults), token=lambda: "t")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def pod(objs: dict, name: str) -> dict:
    return objs[f"Deployment/{name}"]["spec"]["template"]["spec"]


def gpu_body() -> dict:
    return example_body("gpu-2p4d-external-redis")


def test_redis_discovery_gives_the_router_no_token_and_no_rbac():
    objs = render(gpu_body())
    assert not any(k.split("/")[0] in ("ServiceAccount", "Role", "RoleBinding") for k in objs)
    for name in ("llama-2p4d-router", "llama-2p4d-prefill", "llama-2p4d-decode"):
        assert pod(objs, name)["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod(objs, name)


def test_kubernetes_discovery_gets_a_read_only_endpointslice_role():
    body = gpu_body()
    body["spec"]["router"]["discovery"] = "kubernetes"
    objs = render(body)
    router = pod(objs, "llama-2p4d-router")
    assert router["automountServiceAccountToken"] is True
    assert router["serviceAccountName"] == "llama-2p4d-router"
    assert objs["Role/llama-2p4d-router"]["rules"] == DISCOVERY_RULES == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = objs["RoleBinding/llama-2p4d-router"]
    assert binding["roleRef"]["name"] == "llama-2p4d-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-2p4d-router", "namespace": "serving"}]
    for node in ("llama-2p4d-prefill", "llama-2p4d-decode"):  # nodes never get a token
        assert pod(objs, node)["automountServiceAccountToken"] is False
    # the rendered args parse through the router's real CLI, with --kubernetes on
    args = router["containers"][0]["args"]
    assert args[0] == "router" and "--kubernetes" in args
    cfg, sched = settings.load(args[1:], environ={})
    settings.profile(cfg, sched)
    assert cfg.router.kubernetes and cfg.router.pool == "llama-2p4d" and cfg.router.namespace == "serving"


def test_switching_back_to_redis_discovery_nulls_the_service_account():
    body = gpu_body()
    body["spec"]["router"]["discovery"] = "kubernetes"
    actual = render(body)["Deployment/llama-2p4d-router"]
    actual["spec"]["template"]["spec"]["serviceAccount"] = "llama-2p4d-router"  # the API server's alias
    desired = render(gpu_body())["Deployment/llama-2p4d-router"]
    patch = merge_patch(desired, actual)["spec"]["template"]["spec"]
    assert patch["serviceAccountName"] is None and patch["serviceAccount"] is None
    assert patch["automountServiceAccountToken"] is False


def test_rdma_shm_and_topology_placement_reach_the_node_pods_only():
    body = gpu_body()
    body["spec"]["kvTransfer"].update(rdma={"ipcLock": True}, shmSize="16Gi")
    body["spec"]["placement"] = {"topologyKey": "nvidia.com/gpu.clique", "mode": "required"}
    objs = render(body)
    for role in ("prefill", "decode"):
        spec = pod(objs, f"llama-2p4d-{role}")
        (c,) = spec["containers"]
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["resources"]["limits"]["rdma/ib"] == 1
        (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "nvidia.com/gpu.clique"
        labels = objs[f"Deployment/llama-2p4d-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert _selects(term["labelSelector"], labels)
    env = objs["ConfigMap/llama-2p4d-config"]["data"]
    assert env["UCX_TLS"] == "rc,cuda_copy" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    router = pod(objs, "llama-2p4d-router")
    assert "affinity" not in router and "securityContext" not in router["containers"][0]
    body["spec"]["placement"]["mode"] = "preferred"
    (pref,) = pod(render(body), "llama-2p4d-decode")["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["weight"] == 100 and pref["podAffinityTerm"]["topologyKey"] == "nvidia.com/gpu.clique"


def test_object_store_source_downloads_in_an_init_container():
    body = gpu_body()
    body["spec"]["model"]["source"] = {"objectStore": {
        "uri": "s3://models/llama-3.1-8b", "endpointUrl": "http://minio.infra:9000",
        "credentialsSecretRef": {"name": "s3-creds"}, "sizeLimit": "40Gi"}}
    objs = render(body)
    node = pod(objs, "llama-2p4d-decode")
    (init,) = node["initContainers"]
    assert init["command"] == ["aws"]
    assert init["args"][-2:] == ["s3://models/llama-3.1-8b", "/models"]
    assert init["args"][init["args"].index("--endpoint-url") + 1] == "http://minio.infra:9000"
    assert "--exclude" not in init["args"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}} in node["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in node["containers"][0]["volumeMounts"]
    (router_init,) = pod(objs, "llama-2p4d-router")["initContainers"]  # tokenizer only: no weight files
    assert "*.safetensors" in router_init["args"]


def test_oci_image_volume_source():
    body = gpu_body()
    body["spec"]["model"]["source"] = {"image": {"reference": "ghcr.io/acme/llama-3.1-8b:1"}}
    node = pod(render(body), "llama-2p4d-prefill")
    assert {"name": "model", "image": {"reference": "ghcr.io/acme/llama-3.1-8b:1",
                                       "pullPolicy": "IfNotPresent"}} in node["volumes"]
    assert "initContainers" not in node


def test_one_model_source_only():
    body = gpu_body()
    body["spec"]["model"]["source"]["image"] = {"reference": "x"}
    with pytest.raises(SpecError, match="set one of"):
        parse_pool(body)


@pytest.mark.parametrize("timeout, failures", [(600, 120), (1800, 360), (33, 7)])
def test_startup_probe_is_sized_by_the_load_timeout(timeout, failures):
    body = gpu_body()
    body["spec"]["model"]["loadTimeoutSeconds"] = timeout
    probe = pod(render(body), "llama-2p4d-prefill")["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= timeout
    assert probe["failureThreshold"] == failures


def test_scrapers_reach_the_nodes_http_port_only():
    body = gpu_body()
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    body["spec"]["networkPolicy"] = {"scrapeFrom": [peer]}
    policy = render(body)["NetworkPolicy/llama-2p4d-nodes"]
    rule = policy["spec"]["ingress"][-1]
    assert rule == {"from": [peer], "ports": [{"protocol": "TCP", "port": 8000}]}


def test_pool_defaults_apply_under_the_pool_and_the_pool_wins(tmp_path):
    defaults = {"kvTransfer": {"ucxNetDevices": "mlx5_1:1", "ucxTls": "rc,cuda_copy", "rdma": {"ipcLock": True}},
                "placement": {"topologyKey": "topology.kubernetes.io/rack"}}
    body = gpu_body()  # sets ucxNetDevices mlx5_0:1 itself
    spec_schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    body["spec"] = crd.apply_defaults(body["spec"], spec_schema)  # as stored: the API server's defaults in
    objs = render(body, defaults)
    assert objs["ConfigMap/llama-2p4d-config"]["data"]["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert pod(objs, "llama-2p4d-decode")["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert "affinity" in pod(objs, "llama-2p4d-decode")
    del body["spec"]["kvTransfer"]["ucxNetDevices"]
    assert render(body, defaults)["ConfigMap/llama-2p4d-config"]["data"]["UCX_NET_DEVICES"] == "mlx5_1:1"
    assert defaults["kvTransfer"]["ucxNetDevices"] == "mlx5_1:1"  # not mutated
    path = tmp_path / "defaults.yaml"
    path.write_text(yaml.safe_dump(defaults))
    assert load_pool_defaults(str(path)) == defaults
    path.write_text(yaml.safe_dump({"kvTransfer": {"rdma": {"ipcLok": True}}}))
    with pytest.raises(SystemExit, match="ipcLok: unknown field"):
        load_pool_defaults(str(path))
    path.write_text(yaml.safe_dump({"kvTransfer": {"failurePolicy": "fail"}}))  # the CRD defaults it
    with pytest.raises(SystemExit, match="failurePolicy: has a CRD default"):
        load_pool_defaults(str(path))


def test_image_pull_secrets_reach_every_pod_of_the_pool():
    body = gpu_body()
    del body["spec"]["redis"]  # a managed Redis: its pod pulls redis.image, which may be mirrored privately too
    body["spec"]["model"]["source"] = {"objectStore": {"uri": "s3://models/llama"}}  # an init container's image
    body["spec"]["imagePullSecrets"] = [{"name": "ghcr-pull"}, {"name": "mirror-pull"}]
    objs = render(body)  # every object validates against the 1.33 schemas
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.35", strict=True)
    pods = {name: pod(objs, name) for name in
            ("llama-2p4d-prefill", "llama-2p4d-decode", "llama-2p4d-router", "llama-2p4d-redis")}
    for name, spec in pods.items():
        assert spec["imagePullSecrets"] == [{"name": "ghcr-pull"}, {"name": "mirror-pull"}], name
    # set in the operator's --pool-defaults, it applies to pools that do not set it (a list: the pool's replaces it)
    spec_schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert crd.schema_errors({"imagePullSecrets": [{"name": "x"}]}, spec_schema, "poolDefaults") == []
    assert crd.schema_errors({"imagePullSecrets": [{"nmae": "x"}]}, spec_schema, "poolDefaults") != []
    del body["spec"]["imagePullSecrets"]
    defaulted = render(body, {"imagePullSecrets": [{"name": "cluster-pull"}]})
    assert pod(defaulted, "llama-2p4d-redis")["imagePullSecrets"] == [{"name": "cluster-pull"}]
    # removed from the spec: the Deployment's field is nulled by the merge patch, not left behind
    plain = render(body)
    assert all("imagePullSecrets" not in pod(plain, name) for name in pods)
    patch = merge_patch(plain["Deployment/llama-2p4d-decode"], objs["Deployment/llama-2p4d-decode"])
    assert patch["spec"]["template"]["spec"]["imagePullSecrets"] is None


def test_example_pools_still_render_the_same_without_the_new_fields():
    body = example_body("cpu-demo")
    assert render(copy.deepcopy(body)) == render(body, {})


def test_crd_file_is_regenerated():
    out = subprocess.run(["pdpool", "operator", "crd"], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={"PATH": str(ROOT / ".venv" / "bin")}).stdout
    assert out == (ROOT / "operator" / "crd.yaml").read_text()
