"""The finalizer of an operator as it runs in the cluster (no --managed-redis-url): a managed Redis's keys go with
it, so deleting its pool never waits on Redis; an external Redis, even one set by --pool-defaults, is cleaned."""

from __future__ import annotations

import json
import time

import pytest
import redis
import yaml

from operator_procs import OperatorProcess, wait_until
from operator_examples import ROOT
from pdpool.kv_index.keys import key_prefix

POOL = "inferencepools.pdpool.io"


@pytest.fixture(scope="module")
def operator(cluster, redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operator")
    defaults = tmp / "pool-defaults.yaml"
    defaults.write_text(yaml.safe_dump({"redis": {"url": redis_server.url}}))
    cluster.kubectl("apply", "-f", str(ROOT / "operator" / "crd.yaml"))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shared"}}))
    procs = [OperatorProcess(cluster.kubeconfig, tmp, "op-managed", "--lease-name", "op-managed"),
             OperatorProcess(cluster.kubeconfig, tmp, "op-shared", "--lease-name", "op-shared",
                             "--pool-defaults", str(defaults), namespace="shared")]
    yield procs
    for proc in procs:
        proc.stop()


def create(cluster, name: str, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(
        {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": name}, "spec": {}}))
    wait_until(lambda: "pdpool.io/redis-keys" in (cluster.kubectl.json("get", POOL, name, "-n", namespace)
                                                  ["metadata"].get("finalizers") or []),
               what=f"{namespace}/{name} has the finalizer")


def test_deleting_a_pool_with_a_managed_redis_does_not_wait_on_it(cluster, operator):
    create(cluster, "managed", "default")
    wait_until(lambda: cluster.kubectl("get", "deployment", "managed-redis", check=False).returncode == 0,
               what="the managed Redis")
    started = time.monotonic()
    cluster.kubectl("delete", POOL, "managed", "--timeout=20s")
    took = time.monotonic() - started
    assert took < 5, f"deletion took {took:.1f}s"  # before: 31 s of retries on an unreachable Redis
    events = cluster.kubectl.json("get", "events")["items"]
    assert not [e for e in events if e["involvedObject"].get("name") == "managed"
                and e["reason"] == "RedisKeysLeft"], events
    assert "unreachable" not in operator[0].log()


def test_an_external_redis_from_the_pool_defaults_is_cleaned(cluster, operator, redis_server):
    create(cluster, "shared-pool", "shared")
    deployment = cluster.kubectl.json("get", "deployment", "shared-pool-decode", "-n", "shared")
    assert redis_server.url in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    r = redis.Redis(port=redis_server.port)
    mine, other = key_prefix("shared", "shared-pool"), key_prefix("shared", "other")
    for i in range(10):
        r.set(f"{mine}block:{i}", i)
    r.set(f"{other}block:1", 1)
    cluster.kubectl("delete", POOL, "shared-pool", "-n", "shared", "--timeout=20s")
    assert list(r.scan_iter(match=mine + "*")) == []  # before: the finalizer tried shared-pool-redis.shared.svc
    assert r.get(f"{other}block:1") == b"1"
