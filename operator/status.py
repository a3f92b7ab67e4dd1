"""Pure: a pool's children → its status (phase, conditions, replicas per role, endpoint).

Ready means every role is rolled out at the generation the operator last applied: each Deployment's
``status.observedGeneration`` has caught up with its ``metadata.generation``, every replica is updated, none of
the old ones is left, and at least one is ready. Conditions keep their ``lastTransitionTime`` until their
status flips, so an unchanged pool gets an unchanged status (and no write).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "router")
# Roles a pool can serve without: with no prefill node, the router sends every request decode-only.
OPTIONAL_ROLES = ("prefill",)


@dataclass(frozen=True)
class Rollout:
    name: str
    desired: int
    ready: int
    updated: int
    done: bool           # controller caught up with the spec and no old replicas remain
    failed: str | None   # ReplicaFailure / ProgressDeadlineExceeded message
    summary: str


def rollout(name: str, dep: dict | None) -> Rollout:
    if dep is None:
        return Rollout(name, 0, 0, 0, False, None, "0/0")
    spec, st = dep.get("spec") or {}, dep.get("status") or {}
    desired = spec.get("replicas", 1)
    ready, updated, total = st.get("readyReplicas", 0), st.get("updatedReplicas", 0), st.get("replicas", 0)
    caught_up = st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 1)
    failed = None
    for c in st.get("conditions") or []:
        if (c.get("type") == "ReplicaFailure" and c.get("status") == "True") or \
                (c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"):
            failed = f"{name}: {c.get('message') or c.get('reason')}"
    done = caught_up and updated >= desired and total <= updated
    return Rollout(name, desired, ready, updated, done, failed, f"{ready}/{desired}")


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int, previous: dict, now: str) -> dict:
    status = "True" if ok else "False"
    old = previous.get(type_) or {}
    since = old["lastTransitionTime"] if old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def compute(*, generation: int, applied_generation: int, deployments: dict[str, dict | None],
            endpoint: str | None, error: tuple[str, str] | None, previous: dict, now: str) -> dict:
    """``deployments``: role (prefill, decode, router, and redis when managed) → Deployment or None.
    ``error``: (reason, message) when the spec cannot be deployed. ``previous``: the current status."""
    prev = {c["type"]: c for c in previous.get("conditions") or []}
    rollouts = {role: rollout(role, dep) for role, dep in deployments.items()}
    cond = lambda *a: _condition(*a, applied_generation, prev, now)  # noqa: E731

    failed = [r.failed for r in rollouts.values() if r.failed]
    if error:
        reason, message = error
        degraded, ready, progressing = (True, reason, message), (False, reason, message), (False, reason, message)
    elif applied_generation < generation:
        msg = f"generation {generation} is not applied yet (applied: {applied_generation})"
        degraded, ready, progressing = (False, "AsExpected", ""), (False, "Reconciling", msg), (True, "Reconciling", msg)
    else:
        rolling = [f"{r.name} ({r.updated}/{r.desired} updated)" for r in rollouts.values() if not r.done]
        short = [f"{r.name} ({r.ready}/{r.desired} ready)" for r in rollouts.values()
                 if r.done and (r.ready < r.desired or (r.desired == 0 and r.name not in OPTIONAL_ROLES))]
        degraded = (True, "RolloutFailed", "; ".join(failed)) if failed else (False, "AsExpected", "")
        if rolling:
            msg = "rolling out: " + ", ".join(rolling)
            ready, progressing = (False, "RolloutInProgress", msg), (True, "RollingOut", msg)
        else:
            progressing = (False, "RolloutComplete", "every role runs the current spec")
            ready = (False, "ReplicasNotReady", "not ready: " + ", ".join(short)) if short else \
                (True, "AllReplicasReady", "every role has all its replicas ready")
    conditions = [cond("Ready", *ready), cond("Progressing", *progressing), cond("Degraded", *degraded)]
    phase = "Degraded" if degraded[0] else "Ready" if ready[0] else \
        "Pending" if not any(deployments.values()) else "Progressing"
    out = {"observedGeneration": applied_generation, "phase": phase, "conditions": conditions,
           "replicas": {role: {"desired": r.desired, "ready": r.ready, "updated": r.updated, "summary": r.summary}
                        for role, r in rollouts.items() if role in ROLES}}
    if endpoint:
        out["endpoint"] = endpoint
    return out


def changes(current: dict, wanted: dict) -> dict:
    """The top-level status keys whose value differs (what a merge patch must carry)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}
