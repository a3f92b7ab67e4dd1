"""A pool's life as ``kubectl`` users meet it: deleting it with what it referenced already gone, and two pools in
one namespace whose generated names meet. Real kopf (``pdpool operator``), real kubectl, a real redis-server."""

from __future__ import annotations

import json
import time

import redis

from operator_procs import posted_within, wait_until
from pdpool.kv_index.keys import key_prefix

POOL = "inferencepools.pdpool.io"


def apply(cluster, name: str, spec: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": name}, "spec": spec}))


def conditions(cluster, name: str) -> dict:
    pool = cluster.kubectl.json("get", POOL, name)
    return {c["type"]: c for c in (pool.get("status") or {}).get("conditions") or []}


def events(cluster, name: str, reason: str) -> list[dict]:
    return [e for e in cluster.kubectl.json("get", "events")["items"]
            if e["involvedObject"].get("name") == name and e["reason"] == reason]


def test_deleting_a_pool_whose_redis_password_secret_is_gone_does_not_hang(cluster, plain_operator, redis_server):
    """``kubectl delete -f`` of a file holding the password Secret before the pool: the finalizer cannot log in to
    Redis, and no retry will change that. Before, it retried for 31 s (kubectl delete waited) and then gave up."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ext-redis"},
              "stringData": {"password": "pw-1"}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
    admin = redis.Redis(port=redis_server.port)
    admin.config_set("requirepass", "pw-1")
    try:
        apply(cluster, "ext", {"redis": {"url": redis_server.url, "passwordSecretRef": {"name": "ext-redis"}}})
        wait_until(lambda: "pdpool.io/redis-keys" in (cluster.kubectl.json("get", POOL, "ext")["metadata"]
                                                      .get("finalizers") or []), what="the finalizer")
        r = redis.Redis(port=redis_server.port, password="pw-1")
        r.set(f"{key_prefix('default', 'ext')}block:1", 1)
        cluster.kubectl("delete", "secret", "ext-redis")
        started = time.monotonic()
        cluster.kubectl("delete", POOL, "ext", "--timeout=60s")
        took = time.monotonic() - started
        assert took < 8, f"deletion took {took:.1f}s"
        (left, *_) = wait_until(lambda: events(cluster, "ext", "RedisKeysLeft"), what="a RedisKeysLeft event")
        assert "ext-redis" in left["message"], left["message"]
    finally:
        redis.Redis(port=redis_server.port, password="pw-1").config_set("requirepass", "")


def test_two_pools_whose_child_names_meet_are_told_whose_object_it_is(cluster, plain_operator):
    """Pool ``twin`` has the Service twin-decode (its decode nodes); pool ``twin-decode`` wants it as its router's
    Service. The second pool is Degraded naming the owner and starts nothing (before, its Deployments up to the
    conflict ran: nodes holding GPUs for a pool with no router); the first is untouched."""
    apply(cluster, "twin", {})
    wait_until(lambda: cluster.kubectl.json("get", "service", "twin-decode"), what="twin's decode Service")
    apply(cluster, "twin-decode", {})
    wait_until(lambda: conditions(cluster, "twin-decode").get("Degraded", {}).get("status") == "True",
               what="twin-decode Degraded")
    degraded = conditions(cluster, "twin-decode")["Degraded"]
    assert degraded["reason"] == "ChildConflict"
    assert "Service/twin-decode" in degraded["message"] and "InferencePool twin" in degraded["message"], degraded
    service = cluster.kubectl.json("get", "service", "twin-decode")
    assert [r["name"] for r in service["metadata"]["ownerReferences"]] == ["twin"]
    started = cluster.kubectl.json("get", "deployments,secrets", "-l", "app.kubernetes.io/instance=twin-decode")
    assert started["items"] == [], [o["metadata"]["name"] for o in started["items"]]
    assert conditions(cluster, "twin").get("Degraded", {}).get("status") == "False"
    for name in ("twin-decode", "twin"):
        cluster.kubectl("delete", POOL, name, "--timeout=20s")


def test_a_generated_secret_deleted_by_hand_restarts_the_pods_that_read_it(cluster, plain_operator):
    """It comes back with a new value; pods read it at start. Before, nothing restarted: the router kept the old
    internal token and every node pod started after it the new one (or the nodes a Redis password Redis lacked)."""
    apply(cluster, "keys", {})
    names = ("keys-prefill", "keys-decode", "keys-router", "keys-redis")
    generation = lambda: {n: cluster.kubectl.json("get", "deployment", n)["metadata"]["generation"]  # noqa: E731
                          for n in names}
    before = wait_until(lambda: generation(), what="the Deployments")
    wait_until(lambda: cluster.kubectl.json("get", POOL, "keys").get("status", {}).get("observedGeneration") == 1,
               what="generation 1 applied")
    token = cluster.kubectl.json("get", "secret", "keys-internal")["data"]["token"]
    cluster.kubectl("delete", "secret", "keys-internal")
    wait_until(lambda: cluster.kubectl.json("get", "secret", "keys-internal")["data"]["token"] != token,
               timeout=10, what="a new internal token")
    after = wait_until(lambda: (g := generation())["keys-router"] > before["keys-router"] and g, timeout=10,
                       what="the router restarted")
    time.sleep(0.5)
    after = generation()
    assert [n for n in names if after[n] > before[n]] == ["keys-prefill", "keys-decode", "keys-router"]
    pod = cluster.kubectl.json("get", "deployment", "keys-decode")["spec"]["template"]
    assert "keys-internal" in pod["metadata"]["annotations"]["pdpool.io/restarted-for"]
    time.sleep(1.0)
    assert generation() == after, "restarted once, not on every tick"
    cluster.kubectl("delete", POOL, "keys", "--timeout=20s")



def test_a_pool_waiting_on_a_secret_says_so_once_in_its_events(cluster, plain_operator):
    """kubectl describe shows why the pool waits, once: the status timer notices when the Secret appears."""
    apply(cluster, "waits", {"router": {"apiKeySecretRef": {"name": "waits-key"}}})
    wait_until(lambda: conditions(cluster, "waits").get("Degraded", {}).get("reason") == "SecretMissing",
               what="SecretMissing")
    time.sleep(11)  # past the change handler's old retry delay (10 s)
    (warning, *_) = warnings = events(cluster, "waits", "SecretMissing")
    assert warning["type"] == "Warning" and "waits-key (key api-key)" in warning["message"], warning
    assert posted_within(warnings) < 5, warnings  # once (kopf may post an Event twice on a slow answer)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Secret",
                                                          "metadata": {"name": "waits-key"},
                                                          "stringData": {"api-key": "k"}}))
    wait_until(lambda: conditions(cluster, "waits").get("Degraded", {}).get("status") == "False", timeout=10,
               what="the Secret found")
    cluster.kubectl("delete", POOL, "waits", "--timeout=20s")
