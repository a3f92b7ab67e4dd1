"""Rendered children of the example pools: golden files, Kubernetes 1.33 schemas, and the invariants."""

from __future__ import annotations

import os

import kubernetes_validate
import pytest
import yaml

from operator_examples import GOLDEN, NAMES, admits, example_body, make_body
from pdpool import config
from pdpool.operator import builders
from pdpool.operator.builders.common import ROLE_LABEL, SPEC_HASH
from pdpool.operator.spec import parse_pool

REGENERATE = os.environ.get("PDPOOL_REGEN_GOLDEN") == "1"  # PDPOOL_REGEN_GOLDEN=1 pytest tests/operator


def render(name: str) -> list[dict]:
    return builders.render(parse_pool(example_body(name)), token=lambda: "generated-once")


@pytest.mark.parametrize("name", NAMES)
def test_golden(name):
    got = yaml.safe_dump_all(render(name), sort_keys=False, width=120)
    path = GOLDEN / f"{name}.yaml"
    if REGENERATE:
        path.write_text(got)
    assert path.read_text() == got, f"rendered objects drifted from {path}; review, then PDPOOL_REGEN_GOLDEN=1"


@pytest.mark.parametrize("version", ["1.33", "1.35"])
@pytest.mark.parametrize("name", NAMES)
def test_every_object_validates_against_kubernetes(name, version):
    for obj in render(name):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", NAMES)
def test_every_child_is_owned_labelled_and_hashed(name):
    body = example_body(name)
    for obj in render(name):
        meta = obj["metadata"]
        (ref,) = meta["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
            ("InferencePool", body["metadata"]["name"], body["metadata"]["uid"], True)
        assert meta["labels"]["app.kubernetes.io/instance"] == body["metadata"]["name"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdpool-operator"
        assert len(meta["annotations"][SPEC_HASH]) == 16


def _deployments(objs):
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objs if o["kind"] == "Deployment"}


def _parse_serve(args: list[str]) -> config.NodeConfig:
    import argparse

    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(args[1:]), environ={})


def test_node_containers_run_pdpool_serve_with_the_spec_as_flags():
    deps = _deployments(render("gpu-1p1d"))
    for role in ("prefill", "decode"):
        pod = deps[role]["spec"]["template"]
        assert pod["metadata"]["labels"][ROLE_LABEL] == role
        (c,) = pod["spec"]["containers"]
        cfg = _parse_serve(c["args"])
        assert (cfg.server.role, cfg.device.device, cfg.model.dtype) == (role, "cuda", "bfloat16")
        assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len, cfg.disagg.ucx_tls) == \
            (128, 8192, "cuda_ipc,cuda_copy,tcp")
        assert cfg.disagg.redis == "redis://qwen-1p1d-redis.default.svc:6379/0"
        assert cfg.model.model == "/models/Qwen2.5-7B-Instruct"
        env = {e["name"]: e for e in c["env"]}
        for secret in ("PDPOOL_API_KEY", "PDPOOL_REDIS_PASSWORD", "PDPOOL_INTERNAL_TOKEN"):
            assert "secretKeyRef" in env[secret]["valueFrom"], secret
        assert not any("password" in a.lower() or "key=" in a for a in c["args"])
        assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert c["startupProbe"]["httpGet"]["path"] == "/health/ready"   # the load (test_operator_startup_probe)
        assert "pdpool.operator.drain" in c["lifecycle"]["preStop"]["exec"]["command"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > cfg.disagg.kv_lease_seconds
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["volumeMounts"][0]["mountPath"] == "/models"


def test_router_runs_pdpool_router_with_router_flags():
    deps = _deployments(render("gpu-2p4d-external-redis"))
    (c,) = deps["router"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][:1] == ["router"]
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, config.RouterCommandConfig)
    cfg = config.from_args(parser.parse_args(c["args"][1:]), config.RouterCommandConfig, environ={})
    r = cfg.router
    assert (r.prefix_weight, r.kv_usage_weight, r.disagg_min_tokens, r.workers) == (4, 1, 256, 4)
    assert cfg.router.redis == "redis://redis.infra.svc:6379/3"
    assert deps["router"]["spec"]["replicas"] == 2 and deps["decode"]["spec"]["replicas"] == 4


def test_external_redis_means_no_managed_redis():
    objs = render("gpu-2p4d-external-redis")
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]
    dep = _deployments(objs)["decode"]
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PDPOOL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "shared-redis", "key": "password"}


def test_external_redis_without_a_password():
    """redis.url alone (a Redis without auth): no password env, nothing waits for a Secret (a KeyError before)."""
    pool = parse_pool(make_body({"redis": {"url": "redis://redis.infra.svc:6379/0"}}))
    assert pool.redis_password is None
    objs = builders.render(pool, token=lambda: "t")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.35", strict=True)
    assert not [o for o in objs if o["metadata"]["name"] == "p-redis"]
    deps = _deployments(objs)
    for role in ("prefill", "decode", "router"):
        (c,) = deps[role]["spec"]["template"]["spec"]["containers"]
        assert "PDPOOL_REDIS_PASSWORD" not in {e["name"] for e in c["env"]}, role
        assert "redis://redis.infra.svc:6379/0" in c["args"]
    assert _parse_serve(deps["decode"]["spec"]["template"]["spec"]["containers"][0]["args"]).disagg.redis_password \
        is None


def test_managed_redis_and_network_policies():
    objs = {f"{o['kind']}/{o['metadata']['name']}": o for o in render("cpu-demo")}
    assert objs["Secret/demo-redis"]["data"]["password"]
    redis_np = objs["NetworkPolicy/demo-redis"]["spec"]
    assert redis_np["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/instance": "demo", "app.kubernetes.io/part-of": "pdpool"}}}]
    assert [p["port"] for p in redis_np["ingress"][0]["ports"]] == [6379]
    nodes_np = objs["NetworkPolicy/demo-nodes"]
    pods = {c: objs[f"Deployment/demo-{c}"]["spec"]["template"]["metadata"]["labels"]
            for c in ("prefill", "decode", "router", "redis")}
    # only the router reaches the nodes' HTTP port (OpenAI and /internal routes) from outside the node set;
    # only nodes reach each other's NIXL port (and UCX's ephemeral TCP ports)
    assert admits(nodes_np, pods["router"], pods["prefill"], 8000)
    assert not admits(nodes_np, pods["router"], pods["decode"], 5600)
    assert admits(nodes_np, pods["decode"], pods["prefill"], 5600)
    assert admits(nodes_np, pods["prefill"], pods["decode"], 41234)
    assert not admits(nodes_np, pods["redis"], pods["prefill"], 8000)
    assert not admits(nodes_np, pods["redis"], pods["decode"], 5600)
    assert not admits(nodes_np, {"app": "other"}, pods["prefill"], 8000)
    assert not admits(nodes_np, pods["prefill"], pods["router"], 8000), "the router's pods are not selected"


def test_unset_replicas_leave_scaling_to_an_autoscaler():
    pool = parse_pool(make_body({"decode": {}, "prefill": {"replicas": 2}}))
    deps = _deployments(builders.render(pool))
    assert "replicas" not in deps["decode"]["spec"]
    assert deps["prefill"]["spec"]["replicas"] == 2


def test_hash_changes_only_for_the_child_that_changed():
    before = {o["metadata"]["name"]: o for o in render("cpu-demo")}
    body = example_body("cpu-demo")
    body["spec"]["decode"]["replicas"] = 3
    after = {o["metadata"]["name"]: o for o in builders.render(parse_pool(body), token=lambda: "generated-once")}
    changed = {n for n in before if before[n]["metadata"]["annotations"][SPEC_HASH]
               != after[n]["metadata"]["annotations"][SPEC_HASH]}
    assert changed == {"demo-decode"}
