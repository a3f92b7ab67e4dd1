"""API semantics on the store: create, read, update, patch, delete, garbage collection.

Everything here raises `ApiError`; the HTTP layer only parses and renders.
"""

from __future__ import annotations

import copy
import datetime
import secrets
import string
import uuid

from . import admission, crds, defaults, patching, schemas
from .errors import ApiError, already_exists, conflict, invalid, not_found
from .garbage import GarbageCollector
from .resources import Registry, ResourceType
from .store import Store

IMMUTABLE_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(rt: ResourceType, obj: dict) -> dict:
    skip = {"metadata", "apiVersion", "kind"} | ({"status"} if rt.status_subresource else set())
    return {k: v for k, v in obj.items() if k not in skip}


class Api:
    def __init__(self, store: Store, registry: Registry):
        self.store = store
        self.registry = registry
        self.gc = GarbageCollector(self)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(self.registry.get("", "v1", "namespaces"), None, {"metadata": {"name": ns}})

    # -- reads -------------------------------------------------------------------------------

    def present(self, rt: ResourceType, obj: dict) -> dict:
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        return obj

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        obj = self.store.get(rt.store_key, namespace or "", name)
        if obj is None:
            raise not_found(rt, name)
        return self.present(rt, obj)

    def list(self, rt: ResourceType, namespace: str | None) -> tuple[list[dict], str]:
        with self.store.lock:
            items = self.store.list(rt.store_key, namespace)
            return [self.present(rt, o) for o in items], str(self.store.resource_version)

    # -- writes ------------------------------------------------------------------------------

    def _check_namespace(self, rt: ResourceType, namespace: str | None) -> None:
        if rt.namespaced and self.store.get(("", "namespaces"), "", namespace or "") is None:
            raise ApiError(404, f'namespaces "{namespace}" not found',
                           details={"name": namespace, "kind": "namespaces"})

    def _normalize(self, rt: ResourceType, namespace: str | None, body: dict) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        if obj.get("apiVersion") not in (None, "", rt.api_version):
            raise ApiError(400, f"the API version in the data ({obj['apiVersion']}) does not match the expected "
                                f"API version ({rt.api_version})")
        if obj.get("kind") not in (None, "", rt.kind):
            raise ApiError(400, f"the kind in the data ({obj['kind']}) does not match the expected kind ({rt.kind})")
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(400, "the namespace of the provided object does not match the namespace "
                                    "sent on the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        return self.present(rt, obj)

    def create(self, rt: ResourceType, namespace: str | None, body: dict,
               field_validation: str | None = None, dry_run: bool = False) -> dict:
        obj = self._normalize(rt, namespace, body)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise ApiError(400, "resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        if rt.status_subresource:
            obj.pop("status", None)
        admission.validate_metadata(rt, obj)
        self._check_namespace(rt, namespace)
        admission.admit(rt, obj, field_validation)
        defaults.apply(rt, obj)
        if rt.plural == "customresourcedefinitions":
            crds.check(rt, obj)
            obj["status"] = crds.established_status(obj)
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        if rt.tracks_generation:
            meta["generation"] = 1
        with self.store.lock:
            if self.store.get(rt.store_key, namespace or "", meta["name"]) is not None:
                raise already_exists(rt, meta["name"])
            if dry_run:
                return obj
            meta["resourceVersion"] = self.store.next_resource_version()
            self.store.save(rt.store_key, obj, "ADDED")
            if rt.plural == "customresourcedefinitions":
                self.registry.replace_crd(obj["spec"]["group"], obj["spec"]["names"]["plural"],
                                          crds.served_types(obj))
        return copy.deepcopy(obj)

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: dict,
               subresource: str | None = None, field_validation: str | None = None,
               dry_run: bool = False) -> dict:
        with self.store.lock:
            old = self.get(rt, namespace, name)
            new = self._normalize(rt, namespace, body)
            if rt.from_crd and not new["metadata"].get("resourceVersion"):
                raise invalid(rt, name, [{"reason": "FieldValueInvalid", "field": "metadata.resourceVersion",
                                          "message": "Invalid value: 0: must be specified for an update"}])
            return self._write(rt, old, new, subresource, field_validation, dry_run)

    def patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, patch,
              subresource: str | None = None, field_validation: str | None = None,
              dry_run: bool = False) -> dict:
        with self.store.lock:
            old = self.get(rt, namespace, name)
            if content_type == patching.MERGE:
                new = patching.merge_patch(old, patch)
            elif content_type == patching.JSON_PATCH:
                new = patching.json_patch(old, patch)
            elif content_type == patching.STRATEGIC:
                if rt.from_crd:
                    raise ApiError(415, f"the body of the request was in an unknown format - accepted media "
                                        f"types include: {patching.JSON_PATCH}, {patching.MERGE}, {patching.APPLY}")
                def_name = schemas.builtin_def_name(rt.group, rt.version, rt.kind)
                schema = {"$ref": f"#/$defs/{def_name}"} if def_name else {}
                new = patching.strategic_merge(old, patch, schema, schemas.resolve_builtin)
            else:
                raise ApiError(415, f"the emulator does not accept patches of type {content_type}")
            if not isinstance(new, dict):
                raise ApiError(422, "the patch did not produce an object")
            new = self._normalize(rt, namespace, new)
            return self._write(rt, old, new, subresource, field_validation, dry_run)

    def _write(self, rt, old: dict, new: dict, subresource, field_validation, dry_run) -> dict:
        name = old["metadata"]["name"]
        stale = new["metadata"].get("resourceVersion")
        if stale and stale != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        if new["metadata"].get("name", name) != name:
            raise ApiError(400, f'the name of the object ({new["metadata"]["name"]}) does not match the name '
                                f"on the URL ({name})")
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            new.pop("status", None)
            if status is not None:
                new["status"] = status
        elif subresource:
            raise ApiError(404, f"the subresource {subresource!r} is not served", reason="NotFound")
        elif rt.status_subresource:
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        meta, old_meta = new["metadata"], old["metadata"]
        meta["name"] = name
        for key in IMMUTABLE_META:
            meta.pop(key, None)
            if key in old_meta:
                meta[key] = old_meta[key]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise ApiError(422, f"Forbidden: no new finalizers can be added if the object is being deleted, "
                                    f"found new finalizers {sorted(added)}", reason="Invalid")
        if subresource != "status":
            admission.validate_metadata(rt, new)
        admission.admit(rt, new, field_validation)
        if subresource != "status":
            defaults.carry_over(rt, old, new)
            defaults.apply(rt, new)
        if rt.plural == "customresourcedefinitions" and subresource != "status":
            crds.check(rt, new)
            new["status"] = crds.established_status(new)
        if rt.tracks_generation and _spec_part(rt, new) != _spec_part(rt, old):
            meta["generation"] = old_meta.get("generation", 1) + 1
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == old or dry_run:
            return new
        meta["resourceVersion"] = self.store.next_resource_version()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.gc.remove(rt, new)
            return new
        self.store.save(rt.store_key, new, "MODIFIED")
        if rt.plural == "customresourcedefinitions":
            self.registry.replace_crd(new["spec"]["group"], new["spec"]["names"]["plural"], crds.served_types(new))
        return new

    # -- deletion ----------------------------------------------------------------------------

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: dict | None = None,
               dry_run: bool = False) -> dict:
        options = options or {}
        with self.store.lock:
            obj = self.get(rt, namespace, name)
            meta = obj["metadata"]
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise ApiError(409, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                                    f"meta: {meta['uid']}", reason="Conflict")
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise conflict(rt, name)
            if dry_run:
                return obj
            if options.get("propagationPolicy") == "Orphan":
                self.gc.orphan_children(meta["uid"])
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = now()
                    meta["deletionGracePeriodSeconds"] = 0
                    if rt.tracks_generation:
                        meta["generation"] = meta.get("generation", 1) + 1
                    meta["resourceVersion"] = self.store.next_resource_version()
                    self.store.save(rt.store_key, obj, "MODIFIED")
                return obj
            meta["resourceVersion"] = self.store.next_resource_version()
            self.gc.remove(rt, obj)
            return obj
