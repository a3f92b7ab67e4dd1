"""Deletion side effects: owner-reference garbage collection, namespace and CRD cleanup.

Collection is synchronous and cascades in the background style: dependents whose owners
are all gone are deleted (their own finalizers respected) right after the owner is removed.
`propagationPolicy: Foreground` is treated like Background; `Orphan` strips the references.
"""

from __future__ import annotations

from .errors import ApiError
from .resources import ResourceType


class GarbageCollector:
    def __init__(self, api):
        self.api = api
        self.store = api.store
        self.registry = api.registry

    def remove(self, rt: ResourceType, obj: dict) -> None:
        meta = obj["metadata"]
        self.store.remove(rt.store_key, obj)
        if rt.plural == "namespaces":
            self._empty_namespace(meta["name"])
        if rt.plural == "customresourcedefinitions":
            self._drop_crd(obj)
        self._collect_garbage(meta["uid"])

    def _empty_namespace(self, namespace: str) -> None:
        for rt in self._storage_types():
            if rt.namespaced:
                for child in self.store.list(rt.store_key, namespace):
                    self._delete_quietly(rt, child)

    def _drop_crd(self, crd: dict) -> None:
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for obj in self.store.list((group, plural)):
            obj["metadata"]["resourceVersion"] = self.store.next_resource_version()
            self.store.remove((group, plural), obj)
        self.registry.replace_crd(group, plural, [])

    def _storage_types(self) -> list[ResourceType]:
        """One served type per stored resource (the first version of each)."""
        seen, out = set(), []
        for rt in self.registry.all():
            if rt.store_key not in seen:
                seen.add(rt.store_key)
                out.append(rt)
        return out

    def _children(self, owner_uid: str):
        for rt in self._storage_types():
            for obj in self.store.list(rt.store_key):
                refs = obj["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == owner_uid for r in refs):
                    yield rt, obj

    def _exists(self, uid: str) -> bool:
        return any(o["metadata"]["uid"] == uid for rt in self._storage_types() for o in self.store.list(rt.store_key))

    def _collect_garbage(self, owner_uid: str) -> None:
        for rt, child in list(self._children(owner_uid)):
            refs = [r for r in child["metadata"]["ownerReferences"] if r.get("uid") != owner_uid]
            if any(self._exists(r.get("uid")) for r in refs):
                child["metadata"]["ownerReferences"] = refs
                child["metadata"]["resourceVersion"] = self.store.next_resource_version()
                self.store.save(rt.store_key, child, "MODIFIED")
            else:
                self._delete_quietly(rt, child)

    def orphan_children(self, owner_uid: str) -> None:
        for rt, child in list(self._children(owner_uid)):
            refs = [r for r in child["metadata"]["ownerReferences"] if r.get("uid") != owner_uid]
            child["metadata"]["ownerReferences"] = refs
            if not refs:
                del child["metadata"]["ownerReferences"]
            child["metadata"]["resourceVersion"] = self.store.next_resource_version()
            self.store.save(rt.store_key, child, "MODIFIED")

    def _delete_quietly(self, rt: ResourceType, obj: dict) -> None:
        try:
            self.api.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        except ApiError:
            pass  # already gone through another owner
