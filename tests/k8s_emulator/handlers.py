"""HTTP handlers of resources: CRUD, list, watch, Table and Scale views, the write and request log entries."""

from __future__ import annotations

import json
import logging
import time

import yaml
from aiohttp import web

from . import patching, routing, scale, tables
from .errors import ApiError, not_implemented
from .selectors import field_matcher, label_matcher
from .watching import serve_watch

log = logging.getLogger("k8s_emulator")
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}


def rbac_verb(method: str, named: bool, watch: bool) -> str:
    """The verb an RBAC authorizer sees for a resource request (as the API server's RequestInfoFactory)."""
    if method == "GET":
        return "get" if named else "watch" if watch else "list"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())

def json_response(body, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def status_response(err: ApiError) -> web.Response:
    return json_response(err.status(), err.code)


def unknown_resource() -> ApiError:
    return ApiError(404, "the server could not find the requested resource", details={"causes": [
        {"reason": "UnexpectedServerResponse", "message": "404 page not found"}]})


async def read_body(request: web.Request):
    raw = await request.read()
    if not raw:
        return None
    try:
        if "yaml" in (request.content_type or ""):
            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as e:
        raise ApiError(400, f"the body of the request could not be decoded: {e}") from e


def _accepts(request: web.Request, what: str) -> bool:
    """Whether the client's first choice of media type is `application/json;as=<what>;...`."""
    first = request.headers.get("Accept", "").split(",")[0]
    params = {p.strip() for p in first.split(";")[1:]}
    return f"as={what}" in params


class Handlers:
    def __init__(self, ctx):
        self.ctx = ctx

    # -- resources ---------------------------------------------------------------------------

    async def resource(self, request: web.Request) -> web.StreamResponse:
        started = time.time()
        target, rt, result_name, code = None, None, None, 500
        try:
            target = routing.parse(request.path)
            if target is None:
                raise not_implemented(f"{request.method} {request.path}")
            # logged when it arrives, as an authorizer sees it (a watch may stay open until the client leaves)
            self.ctx.store.record_request({
                "time": started, "verb": rbac_verb(request.method, bool(target.name),
                                                   request.query.get("watch") in ("true", "1")),
                "group": target.group, "resource": target.plural, "subresource": target.subresource,
                "namespace": target.namespace, "name": target.name,
                "user_agent": request.headers.get("User-Agent", ""),
            })
            rt = self.ctx.registry.get(target.group, target.version, target.plural)
            if rt is None or (target.namespace is not None and not rt.namespaced):
                raise unknown_resource()
            if target.subresource and not ((target.subresource == "status" and rt.status_subresource)
                                           or (target.subresource == "scale" and rt.scale)):
                raise not_implemented(f"the {target.subresource!r} subresource of {rt.plural}")
            before = self._current(rt, target) if request.method in ("PUT", "PATCH") else None
            response = await self._dispatch(request, target, rt)
            code = response.status
            if request.method in ("POST", "PUT", "PATCH") and code < 300 and isinstance(response, web.Response):
                self._record_owner_checks(request, target, before, json.loads(response.body))
            if isinstance(response, web.Response) and response.body and request.method in MUTATING:
                try:
                    result_name = json.loads(response.body)["metadata"].get("name")
                except (ValueError, KeyError, TypeError):
                    pass
            return response
        except ApiError as err:
            code = err.code
            return status_response(err)
        except Exception as exc:  # an emulator bug: answer a Status, as the API server does on panics
            log.exception("emulator failure on %s %s", request.method, request.path)
            code = 500
            return status_response(ApiError(500, f"the emulator failed: {exc!r}"))
        finally:
            if request.method in MUTATING:
                self.ctx.store.record_write({
                    "time": started, "method": request.method, "path": request.path,
                    "query": dict(request.query), "status": code,
                    "kind": rt.kind if rt else None, "resource": rt.plural if rt else None,
                    "group": rt.group if rt else None,
                    "namespace": target.namespace if target else None,
                    "name": (target.name if target and target.name else result_name),
                    "subresource": target.subresource if target else None,
                    "content_type": request.content_type, "user_agent": request.headers.get("User-Agent", ""),
                })

    def _current(self, rt, target) -> dict | None:
        try:
            return self.ctx.api.get(rt, target.namespace, target.name)
        except ApiError:
            return None

    def _record_owner_checks(self, request: web.Request, target, before: dict | None, after: dict) -> None:
        """What the OwnerReferencesPermissionEnforcement admission plugin (on by default in OpenShift, and in
        many hardened clusters) asks the authorizer: setting ``blockOwnerDeletion: true`` on an owner reference
        needs ``update`` on the owner's ``finalizers`` subresource, or the write is forbidden ("cannot set
        blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on")."""
        def blocking(obj: dict | None) -> set[tuple[str, str, str]]:
            refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
            return {(r.get("apiVersion", ""), r.get("kind", ""), r.get("name", "")) for r in refs
                    if r.get("blockOwnerDeletion")}

        for api_version, kind, name in sorted(blocking(after) - blocking(before)):
            owner = self.ctx.registry.by_kind(api_version, kind)
            if owner is None:
                continue
            self.ctx.store.record_request({
                "time": time.time(), "verb": "update", "group": owner.group, "resource": owner.plural,
                "subresource": "finalizers", "namespace": target.namespace, "name": name,
                "user_agent": request.headers.get("User-Agent", ""),
            })

    async def _dispatch(self, request: web.Request, target, rt) -> web.StreamResponse:
        api, q = self.ctx.api, request.query
        ns, name, sub = target.namespace, target.name, target.subresource
        validation = q.get("fieldValidation")
        dry_run = q.get("dryRun") == "All"
        method = request.method
        if sub == "scale":
            return await self._scale(request, rt, ns, name)
        if method == "GET" and name is None:
            return await self._list(request, rt, ns)
        if method == "GET":
            return self._render(request, rt, [api.get(rt, ns, name)], single=True)
        if method == "POST" and name is None:
            if rt.namespaced and ns is None:
                raise ApiError(405, f"create {rt.plural} needs a namespace in the path")
            obj = api.create(rt, ns, await read_body(request), validation, dry_run)
            return json_response(obj, 201)
        if method == "PUT" and name:
            return json_response(api.update(rt, ns, name, await read_body(request), sub, validation, dry_run))
        if method == "PATCH" and name:
            content_type = request.content_type
            if content_type == patching.APPLY:
                raise ApiError(415, "server-side apply is not implemented by the emulator; use kubectl "
                                    "apply without --server-side")
            body = await read_body(request)
            return json_response(api.patch(rt, ns, name, content_type, body, sub, validation, dry_run))
        if method == "DELETE" and name:
            options = await read_body(request) or {}
            if "propagationPolicy" in q:
                options["propagationPolicy"] = q["propagationPolicy"]
            return json_response(api.delete(rt, ns, name, options, dry_run))
        if method == "DELETE":
            return self._delete_collection(request, rt, ns)
        raise ApiError(405, "the server does not allow this method on the requested resource")

    async def _scale(self, request: web.Request, rt, ns, name) -> web.Response:
        if request.method == "GET":
            return json_response(scale.view(rt, self.ctx.api.get(rt, ns, name)))
        if request.method not in ("PUT", "PATCH"):
            raise ApiError(405, "the scale subresource serves get, update and patch")
        content_type = request.content_type if request.method == "PATCH" else None
        return json_response(scale.write(self.ctx.api, rt, ns, name, await read_body(request), content_type))

    def _selected(self, request: web.Request):
        by_label = label_matcher(request.query.get("labelSelector"))
        by_field = field_matcher(request.query.get("fieldSelector"))
        return lambda obj: by_label(obj["metadata"].get("labels")) and by_field(obj)

    async def _list(self, request: web.Request, rt, namespace) -> web.StreamResponse:
        matches = self._selected(request)
        if request.query.get("watch") in ("true", "1"):
            def render(obj):
                if _accepts(request, "Table"):
                    return tables.table(rt, [obj], obj["metadata"]["resourceVersion"],
                                        request.query.get("includeObject", "Metadata"))
                return obj
            return await serve_watch(request, self.ctx, rt, namespace, request.query, matches, render)
        items, rv = self.ctx.api.list(rt, namespace)
        return self._render(request, rt, [o for o in items if matches(o)], resource_version=rv)

    def _render(self, request, rt, items, single: bool = False, resource_version: str | None = None):
        rv = resource_version or (items[0]["metadata"]["resourceVersion"] if items else "0")
        if _accepts(request, "Table"):
            return json_response(tables.table(rt, items, rv, request.query.get("includeObject", "Metadata")))
        if _accepts(request, "PartialObjectMetadata") or _accepts(request, "PartialObjectMetadataList"):
            items = [{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}
                     for o in items]
            if single:
                return json_response(items[0])
            return json_response({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                                  "metadata": {"resourceVersion": rv}, "items": items})
        if single:
            return json_response(items[0])
        return json_response({"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                              "metadata": {"resourceVersion": rv}, "items": items})

    def _delete_collection(self, request, rt, namespace) -> web.Response:
        matches = self._selected(request)
        items, rv = self.ctx.api.list(rt, namespace)
        deleted = []
        for obj in items:
            if matches(obj):
                deleted.append(self.ctx.api.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"]))
        return json_response({"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                              "metadata": {"resourceVersion": rv}, "items": deleted})
