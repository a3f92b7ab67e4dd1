"""Status from children: Ready only when every role is rolled out at the applied generation."""

from __future__ import annotations

from pdpool.operator import status

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(replicas=1, generation=1, observed=1, updated=None, ready=None, total=None):
    updated = replicas if updated is None else updated
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "updatedReplicas": updated,
                       "readyReplicas": replicas if ready is None else ready,
                       "replicas": updated if total is None else total}}


def compute(deps, generation=1, applied=1, error=None, previous=None, now=NOW):
    return status.compute(generation=generation, applied_generation=applied, deployments=deps,
                          endpoint="http://p.default.svc:80", error=error, previous=previous or {}, now=now)


def cond(st, type_):
    return next(c for c in st["conditions"] if c["type"] == type_)


def test_ready_when_every_role_is_rolled_out_and_ready():
    st = compute({"prefill": dep(), "decode": dep(2), "router": dep()})
    assert st["phase"] == "Ready" and cond(st, "Ready")["status"] == "True"
    assert st["replicas"]["decode"] == {"desired": 2, "ready": 2, "updated": 2, "summary": "2/2"}
    assert st["observedGeneration"] == 1 and st["endpoint"] == "http://p.default.svc:80"


def test_a_decode_only_pool_is_ready_and_a_pool_without_decode_is_not():
    st = compute({"prefill": dep(0), "decode": dep(2), "router": dep()})
    assert st["phase"] == "Ready" and cond(st, "Ready")["status"] == "True", cond(st, "Ready")
    assert st["replicas"]["prefill"]["summary"] == "0/0"
    for role in ("decode", "router"):
        st = compute({"prefill": dep(), "decode": dep(), "router": dep(), role: dep(0)})
        assert cond(st, "Ready")["status"] == "False" and f"{role} (0/0 ready)" in cond(st, "Ready")["message"]


def test_not_ready_while_a_deployment_rollout_is_in_progress():
    for stale in (dep(generation=2, observed=1), dep(2, updated=1), dep(1, total=2)):
        st = compute({"prefill": dep(), "decode": stale, "router": dep()})
        assert cond(st, "Ready")["status"] == "False" and cond(st, "Ready")["reason"] == "RolloutInProgress"
        assert cond(st, "Progressing")["status"] == "True" and st["phase"] == "Progressing"


def test_not_ready_until_the_operator_applied_the_new_generation():
    st = compute({"prefill": dep(), "decode": dep(), "router": dep()}, generation=2, applied=1)
    assert cond(st, "Ready")["reason"] == "Reconciling"


def test_invalid_spec_is_degraded_with_its_message():
    st = compute({"prefill": None, "decode": None, "router": None}, error=("InvalidSpec", "engine.device is cuda"))
    assert st["phase"] == "Degraded"
    assert cond(st, "Degraded").items() >= {"status": "True", "reason": "InvalidSpec",
                                          "message": "engine.device is cuda"}.items()


def test_unchanged_children_give_an_identical_status():
    deps = {"prefill": dep(), "decode": dep(), "router": dep()}
    first = compute(deps)
    again = compute(deps, previous=first, now=LATER)
    assert again == first and status.changes(first, again) == {}
    flipped = compute({**deps, "decode": dep(ready=0)}, previous=first, now=LATER)
    assert cond(flipped, "Ready")["lastTransitionTime"] == LATER
    assert cond(flipped, "Degraded")["lastTransitionTime"] == NOW
    assert set(status.changes(first, flipped)) == {"phase", "conditions", "replicas"}
