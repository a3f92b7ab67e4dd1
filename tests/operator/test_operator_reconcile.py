"""Reconcile by diff against the emulator, without kopf: create, no-op, a single patch, a foreign child."""

from __future__ import annotations

import asyncio
import json

import kopf
import pytest

from operator_examples import example_body
from pdpool.operator import builders, reconcile
from pdpool.operator.kube import Kube
from pdpool.operator.spec import parse_pool


def test_apply_creates_then_writes_nothing_then_patches_only_what_changed(cluster):
    async def scenario():
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        body = example_body("gpu-1p1d")
        body["metadata"].update(name="rec", namespace="default")
        pool = parse_pool(body)
        first = await reconcile.apply(kube, builders.render(pool), pool.uid)
        assert first.patched == [] and len(first.created) == 13
        cluster.clear_writes()
        again = await reconcile.apply(kube, builders.render(pool), pool.uid)  # new random tokens: Secrets kept
        assert again.writes == 0 and cluster.writes() == []
        body["spec"]["decode"]["replicas"] = 3
        body["spec"]["decode"].pop("tolerations")
        scaled = await reconcile.apply(kube, builders.render(parse_pool(body)), pool.uid)
        assert (scaled.created, scaled.patched) == ([], ["Deployment/rec-decode"])
        dep = await kube.get("Deployment", "default", "rec-decode")
        assert dep["spec"]["replicas"] == 3 and "tolerations" not in dep["spec"]["template"]["spec"]
        assert [w["method"] for w in cluster.writes()] == ["PATCH"]
        await kube.close()

    asyncio.run(scenario())


def test_a_child_name_taken_by_a_foreign_object_is_a_conflict(cluster):
    async def scenario():
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        await kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "foreign-config", "namespace": "default"}, "data": {}})
        body = example_body("cpu-demo")
        body["metadata"]["name"] = "foreign"
        with pytest.raises(reconcile.ChildConflict, match="ConfigMap/foreign-config exists and is not owned"):
            await reconcile.apply(kube, builders.render(parse_pool(body)), body["metadata"]["uid"])
        await kube.close()

    asyncio.run(scenario())


def test_a_pool_whose_names_are_taken_writes_nothing_and_names_every_taken_child(cluster):
    """Pool ``mix`` needs the Services mix-decode and mix-redis that pools ``mix-decode`` and ``mix-redis`` (their
    routers' Services) already hold. Before, it created children up to the first conflict (Secrets, a managed
    Redis, the prefill Deployment holding its GPUs) for a pool that cannot serve, and named only that one."""
    async def scenario():
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        others = []
        for name in ("mix-decode", "mix-redis"):
            body = example_body("cpu-demo")
            body["metadata"].update(name=name, uid=f"uid-{name}")
            other = parse_pool(body)
            await reconcile.apply(kube, builders.render(other), other.uid)
            others.append(other)
        body = example_body("cpu-demo")
        body["metadata"].update(name="mix", uid="uid-mix")
        pool = parse_pool(body)
        cluster.clear_writes()
        with pytest.raises(reconcile.ChildConflict) as caught:
            await reconcile.apply(kube, builders.render(pool), pool.uid)
        assert "Service/mix-decode exists and is not owned by this InferencePool (owned by InferencePool mix-decode)" \
            in str(caught.value)
        assert "Service/mix-redis" in str(caught.value) and "InferencePool mix-redis" in str(caught.value)
        assert cluster.writes() == []
        assert await kube.get("Deployment", "default", "mix-prefill") is None
        for other in others:
            assert (await reconcile.apply(kube, builders.render(other), other.uid)).writes == 0
        await kube.close()

    asyncio.run(scenario())


def test_orphans_are_adopted_only_by_a_pool_that_is_not_being_deleted(cluster):
    """``kubectl delete --cascade=orphan`` orphans the children while the pool still stands (its finalizer): an
    apply from a copy of the pool read before must not hand them back, or they would go with it. A pool of that
    name applied afterwards adopts them, without writing anything else."""
    from operator_examples import ROOT

    cluster.kubectl("apply", "-f", str(ROOT / "operator" / "crd.yaml"))
    manifest = {"apiVersion": "pdpool.io/v1alpha1", "kind": "InferencePool",
                "metadata": {"name": "adopt", "finalizers": ["test/hold"]}, "spec": {}}

    def stored() -> dict:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        return cluster.kubectl.json("get", "inferencepools.pdpool.io", "adopt")

    async def scenario():
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        old = parse_pool(stored())
        assert len((await reconcile.apply(kube, builders.render(old), old.uid)).created) == 13
        cluster.kubectl("delete", "inferencepools.pdpool.io", "adopt", "--cascade=orphan", "--wait=false")
        assert not (await kube.get("Deployment", "default", "adopt-decode"))["metadata"].get("ownerReferences")
        cluster.clear_writes()
        with pytest.raises(reconcile.ChildConflict, match="not adopted: the pool is being deleted"):
            await reconcile.apply(kube, builders.render(old), old.uid)
        assert cluster.writes() == []
        cluster.kubectl("patch", "inferencepools.pdpool.io", "adopt", "--type=merge",
                        "-p", '{"metadata": {"finalizers": null}}')
        new = parse_pool(stored())
        adopted = await reconcile.apply(kube, builders.render(new), new.uid)
        assert (len(adopted.adopted), adopted.created, adopted.patched) == (13, [], [])
        assert (await kube.get("Secret", "default", "adopt-internal"))["metadata"]["ownerReferences"][0]["uid"] \
            == new.uid
        assert (await reconcile.apply(kube, builders.render(new), new.uid)).writes == 0
        await kube.close()

    asyncio.run(scenario())


def test_a_child_left_by_a_deleted_pool_of_the_same_name_is_named_as_such(cluster):
    """``kubectl delete`` then ``kubectl apply`` of a pool: the new pool (new uid) may run before the garbage
    collector has deleted the old one's children. The conflict said 'owned by InferencePool same' to pool
    ``same`` itself; it now says the owner is the deleted pool and that the garbage collector removes it."""
    async def scenario():
        kube = Kube(kopf.ConnectionInfo(server=cluster.emulator.url))
        old = example_body("cpu-demo", uid="uid-old")
        old["metadata"]["name"] = "same"
        await kube.create(builders.config_map(parse_pool(old)))
        new = example_body("cpu-demo", uid="uid-new")
        new["metadata"]["name"] = "same"
        with pytest.raises(reconcile.ChildConflict) as caught:
            await reconcile.apply(kube, builders.render(parse_pool(new)), "uid-new")
        assert str(caught.value) == ("ConfigMap/same-config exists and is not owned by this InferencePool (owned by "
                                     "the deleted InferencePool same, uid uid-old: the garbage collector deletes it, "
                                     "then this pool creates it)")
        await kube.close()

    asyncio.run(scenario())
