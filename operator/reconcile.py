"""Reconcile by diff: each child carries the hash of what the operator wants (``pdpool.io/spec-hash``).

- absent → create;
- hash equal → nothing (a restart, a resync or a re-apply of the same spec writes nothing);
- hash differs, or a field the operator sets was edited by hand (``kubectl set image``, ``kubectl edit``) → one
  JSON merge patch of the desired fields, plus ``null`` for fields the operator set before and no longer wants.
  Fields the operator never sets (defaults the API server fills in, a Deployment's ``replicas`` when an
  autoscaler owns them, a Service's ``clusterIP``) are never in the patch nor compared (``carries``);
- Secrets are create-only: a generated password is never rotated by a reconcile. One deleted by hand is created
  again with a new value, which the running pods do not have (they read it at start): every existing Deployment
  whose pods read it is restarted (``RESTARTED``), or the router and the nodes, or the nodes and Redis, would hold
  different tokens from the next pod on;
- a child that only some specs have (``prunable``: the managed Redis, the router's RBAC) and the current spec no
  longer wants is deleted, once everything wanted is applied, if this pool owns it: a pool moved to an external
  Redis or back to Redis discovery leaves nothing running behind;
- a child's name held by an object the pool does not own → nothing is written (``ChildConflict``, naming the
  owner), except an orphan carrying this pool's labels (``kubectl delete --cascade=orphan`` left it): it is adopted,
  as a Deployment adopts its orphaned ReplicaSets (``adoptable``).
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field

from pdpool.operator.builders.common import SPEC_HASH
from pdpool.operator.kube import ApiError
from pdpool.operator.quantity import quantity

CREATE_ONLY = {"Secret"}
# The labels that make an orphan this pool's child (builders.common.labels): its pool's name and the operator.
ADOPTION_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by")
RESTARTED = "pdpool.io/restarted-for"  # pod-template annotation: the Secrets recreated under running pods
# Optional pod-spec fields the builders may stop setting; a merge patch must null them out explicitly.
OWNED_OPTIONAL_POD_FIELDS = ("nodeSelector", "tolerations", "volumes", "initContainers", "affinity",
                             "serviceAccountName", "imagePullSecrets")


class ChildConflict(Exception):
    """A child's name is taken by an object this pool does not own."""


@dataclass
class Result:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.patched) + len(self.deleted) + len(self.adopted)


def key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def is_owned_by(actual: dict, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in actual["metadata"].get("ownerReferences") or [])


def adoptable(desired: dict, actual: dict) -> bool:
    """An object with no controlling owner that carries the labels this pool's children carry."""
    meta, labels = actual["metadata"], actual["metadata"].get("labels") or {}
    return not any(ref.get("controller") for ref in meta.get("ownerReferences") or []) and \
        all(labels.get(k) == desired["metadata"]["labels"].get(k) for k in ADOPTION_LABELS)


async def may_adopt(kube, child: dict, uid: str) -> bool:
    """The pool, read again now (not kopf's copy), is still this pool and not being deleted: ``kubectl delete
    --cascade=orphan`` orphans the children while it deletes the pool, and a status tick that read the pool before
    would hand them back to it (Kubernetes' controllers recheck the same way before adopting)."""
    ref = child["metadata"]["ownerReferences"][0]
    pool = await kube.get(ref["kind"], child["metadata"]["namespace"], ref["name"])
    return pool is not None and pool["metadata"]["uid"] == uid and not pool["metadata"].get("deletionTimestamp")


def owners(actual: dict, pool: dict) -> str:
    """Whose ``actual`` is. ``pool``: the owner reference this pool's children carry; one of the same kind and name
    with another uid is a deleted pool's (``kubectl delete`` and ``kubectl apply`` again, before the garbage
    collector has caught up)."""
    def owner(ref: dict) -> str:
        if (ref.get("kind"), ref.get("name")) == (pool["kind"], pool["name"]):
            return (f"the deleted {pool['kind']} {pool['name']}, uid {ref.get('uid')}: the garbage collector deletes "
                    f"it, then this pool creates it")
        return f"{ref.get('kind')} {ref.get('name')}"
    refs = [owner(ref) for ref in actual["metadata"].get("ownerReferences") or []]
    return f"owned by {', '.join(refs)}" if refs else "no owner: created outside any pool"


def conflict(taken: list[tuple[dict, dict]], why: str = "") -> str:
    """What child names held by objects this pool does not own say: whose they are (children grouped by owner)."""
    by_owner: dict[str, list[str]] = {}
    for obj, actual in taken:
        by_owner.setdefault(owners(actual, obj["metadata"]["ownerReferences"][0]), []).append(key(obj))
    return "; ".join(f"{', '.join(keys)} {'exists' if len(keys) == 1 else 'exist'} and "
                     f"{'is' if len(keys) == 1 else 'are'} not owned by this InferencePool ({owner}){why}"
                     for owner, keys in by_owner.items())


def merge_patch(desired: dict, actual: dict) -> dict:
    """The merge patch that makes ``actual`` carry ``desired``; removed owned fields become ``null``."""
    patch = {k: copy.deepcopy(v) for k, v in desired.items() if k not in ("apiVersion", "kind")}
    patch["metadata"] = {k: copy.deepcopy(v) for k, v in desired["metadata"].items()
                         if k in ("labels", "annotations", "ownerReferences")}
    if desired["kind"] == "Deployment":
        want = patch["spec"]["template"]["spec"]
        have = ((actual.get("spec") or {}).get("template") or {}).get("spec") or {}
        for name in OWNED_OPTIONAL_POD_FIELDS:
            if name in have and name not in want:
                want[name] = None
        if want.get("serviceAccountName", "") is None:  # the API server copies the deprecated alias back
            want["serviceAccount"] = None
        if isinstance(want.get("nodeSelector"), dict):
            for label in set(have.get("nodeSelector") or {}) - set(want["nodeSelector"]):
                want["nodeSelector"][label] = None
    if desired["kind"] == "ConfigMap":
        for name in set(actual.get("data") or {}) - set(desired.get("data") or {}):
            patch["data"][name] = None
    return patch


def carries(desired, actual, field: str = "") -> bool:
    """Whether ``actual`` (as the API server stores it) holds every field of ``desired``. Fields the server adds
    (defaults, allocated IPs) are no difference; nor is a zero value it leaves out (``omitempty``: ``readOnly:
    false``, ``value: ""``) or a quantity it canonicalised (``0.5`` is stored as ``500m``, ``1024Mi`` as ``1Gi``).
    Lists are compared element by element: a container added or removed by hand is a difference. ``field``: the
    key ``desired`` sits under."""
    if actual is None:  # left out: an empty value, or a plain bool's false (a pointer's false is stored)
        return desired in ("", {}, []) or (desired is False and field == "readOnly")
    if isinstance(desired, dict):
        inner = "quantity" if field in ("limits", "requests") else ""
        return isinstance(actual, dict) and all(carries(v, actual.get(k), inner or k) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(map(carries, desired, actual))
    if desired == actual and type(desired) is type(actual):
        return True
    return field in ("quantity", "sizeLimit") and quantity(desired) is not None and \
        quantity(desired) == quantity(actual)


def secrets_read(obj: dict) -> set[str]:
    """Names of the Secrets a Deployment's pods read (``secretKeyRef``, ``envFrom``'s ``secretRef``)."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("secretKeyRef", "secretRef") and isinstance(v, dict) and v.get("name"):
                    found.add(v["name"])
                walk(v)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(((obj.get("spec") or {}).get("template") or {}).get("spec"))
    return found


def drifted(desired: dict, actual: dict) -> bool:
    """A field the operator sets differs on the cluster: edited by hand (an image, a port, a replica count the
    pool owns) while the hash annotation, which only says what was last applied, stayed."""
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = {k: desired["metadata"][k] for k in ("labels", "annotations") if k in desired["metadata"]}
    return not carries({**body, "metadata": meta}, actual)


async def apply(kube, desired: list[dict], uid: str, prunable: list[tuple[str, str, str]] = (),
                overridden: set[str] | None = None) -> Result:
    """Bring the children to ``desired``; ``kube`` is a ``pdpool.operator.kube.Kube``. ``prunable``: (kind,
    namespace, name) of the children only some specs have; those not in ``desired`` are deleted when owned.
    ``overridden`` (kept by the caller across calls): children whose repair came back still drifted, because the
    API server's admission (a mutating webhook: Kyverno's 'always pull', say) rewrites a field the pool sets; they
    are not repaired again until their rendering changes, or every status tick would write them."""
    overridden = set() if overridden is None else overridden
    result = Result()
    # Every child is read before any is written: a pool whose names another object holds (pool a-decode's router
    # Service is pool a's decode Service) starts nothing, not the half up to the first conflict.
    actuals = [await kube.get(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]) for obj in desired]
    foreign = [(obj, actual) for obj, actual in zip(desired, actuals) if actual and not is_owned_by(actual, uid)]
    taken = [(obj, actual) for obj, actual in foreign if not adoptable(obj, actual)]
    if taken:
        raise ChildConflict(conflict(taken))
    if foreign and not await may_adopt(kube, desired[0], uid):
        raise ChildConflict(conflict(foreign, "; not adopted: the pool is being deleted"))
    recreated: set[str] = set()  # Secrets created in this pass (the builders render them before their readers)
    for obj, actual in zip(desired, actuals):
        meta = obj["metadata"]
        if actual is None:
            try:
                await kube.create(obj)
            except ApiError as exc:
                if exc.status != 409:  # created meanwhile (by a concurrent handler): compare next time
                    raise
                result.unchanged.append(key(obj))
                continue
            result.created.append(key(obj))
            if obj["kind"] == "Secret":
                recreated.add(meta["name"])
            continue
        adopt = not is_owned_by(actual, uid)  # adoptable (checked above): one patch sets the owner reference
        if adopt and obj["kind"] in CREATE_ONLY:  # a Secret keeps its value, which running pods hold
            await kube.merge_patch(obj["kind"], meta["namespace"], meta["name"],
                                   {"metadata": {"ownerReferences": meta["ownerReferences"]}})
            result.adopted.append(key(obj))
            continue
        want = meta["annotations"][SPEC_HASH]
        repair = (actual["metadata"].get("annotations") or {}).get(SPEC_HASH) == want  # else: a new rendering
        restart = sorted(secrets_read(obj) & recreated) if obj["kind"] == "Deployment" else []
        mark = f"{uid}/{key(obj)}@{want}"
        if not adopt and (obj["kind"] in CREATE_ONLY or
                          (repair and not restart and (mark in overridden or not drifted(obj, actual)))):
            result.unchanged.append(key(obj))
            continue
        patch = merge_patch(obj, actual)
        if restart:
            patch["spec"]["template"]["metadata"].setdefault("annotations", {})[RESTARTED] = \
                f"{','.join(restart)} recreated at {datetime.datetime.now(datetime.timezone.utc).isoformat()}"
        stored = await kube.merge_patch(obj["kind"], meta["namespace"], meta["name"], patch)
        (result.adopted if adopt else result.patched).append(key(obj))
        if repair and not restart and isinstance(stored, dict) and drifted(obj, stored):
            overridden.add(mark)
    wanted = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in desired}
    for kind, namespace, name in prunable:
        if (kind, namespace, name) in wanted:
            continue
        actual = await kube.get(kind, namespace, name)
        if actual is not None and is_owned_by(actual, uid) and await kube.delete(kind, namespace, name):
            result.deleted.append(f"{kind}/{name}")
    return result
