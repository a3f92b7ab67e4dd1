"""Watch streams: newline-delimited `{"type", "object"}` events, resumable, with bookmarks."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .errors import ApiError

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def _as_seen(event_type: str, obj: dict, previous: dict | None, matches) -> str | None:
    """Through a selector, an object that starts matching is ADDED and one that stops is DELETED."""
    now = matches(obj)
    if event_type == "MODIFIED" and previous is not None:
        before = matches(previous)
        if now != before:
            return "ADDED" if now else "DELETED"
    return event_type if now else None


async def serve_watch(request: web.Request, ctx, rt, namespace, params, matches, render) -> web.StreamResponse:
    """`matches(obj)` filters by selectors; `render(obj)` shapes each object (JSON or Table)."""
    api, store = ctx.api, ctx.store
    rv = params.get("resourceVersion") or ""
    send_initial = params.get("sendInitialEvents") == "true"
    bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
    timeout = float(params.get("timeoutSeconds") or 1800)
    loop = asyncio.get_running_loop()
    with store.lock:
        if rv in ("", "0") or send_initial:
            items, _ = api.list(rt, namespace)
            watcher, past, too_old = store.subscribe(rt.store_key, namespace, None, loop)
            past = [(int(o["metadata"]["resourceVersion"]), "ADDED", o, None) for o in items]
        else:
            try:
                since = int(rv)
            except ValueError:
                raise ApiError(400, f"invalid resourceVersion {rv!r}") from None
            watcher, past, too_old = store.subscribe(rt.store_key, namespace, since, loop)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)

    async def send(event_type: str, obj: dict) -> None:
        line = json.dumps({"type": event_type, "object": obj}) + "\n"
        await response.write(line.encode())

    def bookmark(annotations: dict | None = None) -> dict:
        meta = {"resourceVersion": str(store.resource_version)}
        if annotations:
            meta["annotations"] = annotations
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

    try:
        if too_old:
            status = ApiError(410, f"too old resource version: {rv} ({store.resource_version})",
                              reason="Expired").status()
            await send("ERROR", status)
            return response
        for _, event_type, obj, previous in past:
            if shown := _as_seen(event_type, obj, previous, matches):
                await send(shown, render(api.present(rt, obj)))
        if send_initial and bookmarks:
            await send("BOOKMARK", bookmark({INITIAL_EVENTS_END: "true"}))
        deadline = loop.time() + timeout
        while (remaining := deadline - loop.time()) > 0:
            wait = min(remaining, ctx.bookmark_interval) if bookmarks else remaining
            try:
                _, event_type, obj, previous = await asyncio.wait_for(watcher.queue.get(), wait)
            except asyncio.TimeoutError:
                if bookmarks and loop.time() < deadline:
                    await send("BOOKMARK", bookmark())
                continue
            if shown := _as_seen(event_type, obj, previous, matches):
                await send(shown, render(api.present(rt, obj)))
    except ConnectionResetError:
        pass
    finally:
        store.unsubscribe(watcher)
    return response
