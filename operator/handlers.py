"""Thin kopf handlers: body → ``Pool`` → builders → reconcile by diff → status.

``register(registry, options)`` binds them to a registry, so that intervals come from the command line and tests
can run several operators in one interpreter.
"""

from __future__ import annotations

import base64
import copy
import datetime
import logging
from dataclasses import dataclass, field

import kopf
import redis.exceptions

from pdpool.kv_index.cleanup import delete_pool_keys
from pdpool.operator import builders, crd, reconcile, status
from pdpool.operator.kube import ApiError, Kube
from pdpool.operator.spec import Pool, SpecError, merge_defaults, parse_pool

FINALIZER = "pdpool.io/redis-keys"
# The API server refused a child as written: invalid (400, 422), or forbidden (403: an admission webhook such as
# Gatekeeper's or Kyverno's denied it, or the operator's RBAC lacks a verb). Retrying as is cannot help.
REFUSED = (400, 403, 422)
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)


@dataclass
class Options:
    status_interval: float = 5.0
    # Reach managed Redis here instead of its in-cluster Service ("{name}", "{namespace}" are filled in): for an
    # operator running outside the cluster, and for tests.
    managed_redis_url: str | None = None
    finalizer_retries: int = 5
    # A partial spec applied under every pool (--pool-defaults): the cluster's RDMA, UCX and placement settings.
    pool_defaults: dict = field(default_factory=dict)


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdpool.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="pdpool.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events for problems only, not for every handler that succeeded
    # A pool deleted while its status timer runs waits for that run to end before the finalizer is released; kopf
    # looks again after this many seconds (its default, 60, held every such deletion for a minute).
    settings.background.cancellation_polling = 1.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def observe(kube: Kube, body: dict, pool: Pool | None, error: tuple[str, str] | None,
                  applied_generation: int) -> dict:
    """The status the pool should show now, from its Deployments."""
    meta = body["metadata"]
    names = {"prefill": "prefill", "decode": "decode", "router": "router"}
    if pool is not None and pool.managed_redis:
        names["redis"] = "redis"
    deployments = {}
    for role, suffix in names.items():
        dep = await kube.get("Deployment", meta["namespace"], f"{meta['name']}-{suffix}")
        if dep is not None and not reconcile.is_owned_by(dep, meta["uid"]):
            error = error or ("ChildConflict", f"Deployment {dep['metadata']['name']} is not owned by this pool")
            dep = None
        deployments[role] = dep
    return status.compute(generation=meta.get("generation", 1), applied_generation=applied_generation,
                          deployments=deployments, endpoint=builders.endpoint(pool) if pool else None,
                          error=error, previous=dict(body.get("status") or {}), now=_now())


async def missing_secrets(kube: Kube, pool: Pool) -> str | None:
    """Secrets the pool references but does not generate (API key, external Redis password, object store
    credentials), if absent."""
    refs = [pool.api_key, None if pool.managed_redis else pool.redis_password, pool.object_store_credentials]
    missing = []
    for ref in filter(None, refs):
        secret = await kube.get("Secret", pool.namespace, ref.name)
        if secret is None or (ref.key is not None and ref.key not in (secret.get("data") or {})):
            missing.append(ref.name if ref.key is None else f"{ref.name} (key {ref.key})")
    return f"waiting for Secret {', '.join(missing)} in {pool.namespace}" if missing else None


def announce(body: dict, result: reconcile.Result, repair: bool = False) -> None:
    """Normal Events for what ``kubectl describe inferencepool`` should show: the children a spec change adopted,
    created, updated or deleted, and those a status tick restored after a change made outside the pool (``repair``)."""
    parts = [(verb, names) for verb, names in (("adopted", result.adopted), ("created", result.created),
                                                ("updated", result.patched), ("deleted", result.deleted)) if names]
    if repair and parts:
        message = "; ".join(f"{verb} {', '.join(names)}" for verb, names in parts)
        kopf.event(body, type="Normal", reason="Repaired", message=f"undid changes made outside the pool: {message}")
        return
    for verb, names in parts:
        kopf.event(body, type="Normal", reason=verb.capitalize(), message=f"{verb} {', '.join(names)}")


def _set_status(patch: kopf.Patch, body: dict, wanted: dict) -> None:
    for k, v in status.changes(dict(body.get("status") or {}), wanted).items():
        patch.status[k] = v


def register(registry: kopf.OperatorRegistry, options: Options) -> None:
    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
        return memo.connection

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def reconcile_pool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger, **_) -> None:
        generation = body["metadata"].get("generation", 1)
        try:
            pool = parse_pool(dict(body), options.pool_defaults)
        except SpecError as exc:
            _set_status(patch, body, await observe(memo.kube, body, None, ("InvalidSpec", str(exc)), generation))
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            raise kopf.PermanentError(f"invalid spec: {exc}") from None
        try:
            async with memo.locks[pool.uid]:  # never interleaved with the timer's drift repair
                result = await reconcile.apply(memo.kube, builders.render(pool), pool.uid,
                                               builders.prunable(pool), memo.overridden)
        except reconcile.ChildConflict as exc:
            _set_status(patch, body, await observe(memo.kube, body, pool, ("ChildConflict", str(exc)), generation))
            kopf.warn(body, reason="ChildConflict", message=str(exc))
            return  # the status timer applies again every tick (kopf's retries only repeated the Warning)
        except ApiError as exc:
            if exc.status not in REFUSED:  # conflicts, throttling, a webhook down: try again soon
                raise kopf.TemporaryError(f"API: {exc}", delay=5) from None
            # the API server refused a child the spec produced (a field only its Go validation checks, a
            # preserve-unknown-fields value such as scrapeFrom, a policy's webhook): say so where users look
            message = f"the API server refused a child: {exc}"
            _set_status(patch, body, await observe(memo.kube, body, pool, ("ChildRejected", message), generation))
            kopf.warn(body, reason="ChildRejected", message=message)
            return  # as for a conflict: the timer retries, this generation's Warning is posted once
        if result.writes:
            logger.info(f"adopted {result.adopted}, created {result.created}, patched {result.patched}, "
                        f"deleted {result.deleted}")
            announce(body, result)
        waiting = await missing_secrets(memo.kube, pool)
        error = ("SecretMissing", waiting) if waiting else None
        _set_status(patch, body, await observe(memo.kube, body, pool, error, generation))
        if waiting:  # pods cannot start without it (the timer clears the status once it exists)
            kopf.warn(body, reason="SecretMissing", message=waiting)

    @kopf.timer(*RESOURCE, interval=options.status_interval, registry=registry)
    async def refresh_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger, **_) -> None:
        """Status from the children; and drift repair (a child deleted or edited by hand, a hand-scaled
        Deployment whose replicas the pool sets) once the change handlers have applied the current generation."""
        async with memo.locks[body["metadata"]["uid"]]:  # never interleaved with a change handler's apply
            current = copy.deepcopy(dict(body))  # ``body`` is live: read it once, under the lock
            meta, applied = current["metadata"], (current.get("status") or {}).get("observedGeneration", 0)
            try:
                pool, error = parse_pool(current, options.pool_defaults), None
            except SpecError as exc:
                pool, error = None, ("InvalidSpec", str(exc))
            if pool is not None and applied == pool.generation and not meta.get("deletionTimestamp"):
                try:
                    result = await reconcile.apply(memo.kube, builders.render(pool), pool.uid,
                                               builders.prunable(pool), memo.overridden)
                    if result.writes:
                        logger.info(f"repaired drift: created {result.created}, patched {result.patched}, "
                                    f"deleted {result.deleted}")
                        announce(body, result, repair=True)
                except reconcile.ChildConflict as exc:
                    error = ("ChildConflict", str(exc))
                except ApiError as exc:
                    if exc.status not in REFUSED:
                        raise
                    error = ("ChildRejected", f"the API server refused a child: {exc}")
        if pool is not None and error is None:
            waiting = await missing_secrets(memo.kube, pool)
            error = ("SecretMissing", waiting) if waiting else None
        wanted = await observe(memo.kube, current, pool, error, applied)
        # observedGeneration is the change handlers' alone: a timer that read the body just before a handler's
        # status patch must not set it back (later ticks heal everything else it may overwrite)
        wanted.pop("observedGeneration")
        _set_status(patch, current, wanted)

    @kopf.on.delete(*RESOURCE, registry=registry)
    async def drop_redis_keys(body: kopf.Body, memo: kopf.Memo, retry: int, logger, **_) -> None:
        meta = body["metadata"]
        found = await _redis_of(memo.kube, dict(body), options)
        if found is None:  # a managed Redis keeps nothing on disk and goes with the pool: so do its keys
            logger.info(f"managed Redis: the keys of {meta['namespace']}/{meta['name']} go with it")
            return
        url, password, secret = found
        try:
            deleted = await delete_pool_keys(url, password, meta["namespace"], meta["name"])
        except redis.exceptions.AuthenticationError as exc:  # no retry logs in: a password is wrong or its Secret gone
            gone = f" (its password Secret {secret} is gone)" if password is None and secret else ""
            kopf.warn(body, reason="RedisKeysLeft", message=f"could not log in to Redis at {url}{gone}: {exc}")
            return
        except (redis.exceptions.RedisError, OSError) as exc:
            if retry < options.finalizer_retries:
                raise kopf.TemporaryError(f"Redis at {url} unreachable: {exc}", delay=min(2 ** retry, 30)) from None
            kopf.warn(body, reason="RedisKeysLeft", message=f"gave up deleting the pool's Redis keys: {exc}")
            return
        logger.info(f"deleted {deleted} Redis keys of {meta['namespace']}/{meta['name']}")


async def _redis_of(kube: Kube, body: dict, options: Options) -> tuple[str, str | None, str | None] | None:
    """URL, password and password Secret ("name (key k)", None without one) of the Redis whose keys the finalizer
    deletes (its spec may be invalid: only spec.redis,
    over the --pool-defaults, is read). None for a managed Redis the operator does not reach through
    --managed-redis-url: in the cluster its NetworkPolicy admits only the pool's pods, so trying would only hold
    every deletion for the retries and end in a RedisKeysLeft warning."""
    meta = body["metadata"]
    redis_spec = merge_defaults(dict((body.get("spec") or {}).get("redis") or {}),
                                dict(options.pool_defaults.get("redis") or {}))
    if not redis_spec.get("url") and not options.managed_redis_url:
        return None
    if redis_spec.get("url"):
        url, ref = redis_spec["url"], redis_spec.get("passwordSecretRef")
        ref = (ref["name"], ref.get("key", "password")) if ref else None
    else:
        template = options.managed_redis_url or "redis://{name}-redis.{namespace}.svc:6379/0"
        url, ref = template.format(name=meta["name"], namespace=meta["namespace"]), (f"{meta['name']}-redis",
                                                                                    "password")
    if ref is None:
        return url, None, None
    secret = await kube.get("Secret", meta["namespace"], ref[0])
    value = ((secret or {}).get("data") or {}).get(ref[1])
    return url, base64.b64decode(value).decode() if value else None, f"{ref[0]} (key {ref[1]})"
