"""In-memory objects, the global resourceVersion counter, watch fan-out, the write log and the request log.

One lock guards everything. Watchers are asyncio queues fed with
`loop.call_soon_threadsafe`, so the store may be written from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import threading
from dataclasses import dataclass, field

HISTORY = 10000  # watch events kept per resource, for resuming from a resourceVersion


@dataclass(eq=False)
class Watcher:
    store_key: tuple[str, str]
    namespace: str | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def push(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class Store:
    def __init__(self, history: int = HISTORY):
        self.history = history
        self.lock = threading.RLock()
        self.resource_version = 0
        self._objects: dict[tuple, dict[tuple[str, str], dict]] = collections.defaultdict(dict)
        self._history: dict[tuple, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=self.history))
        self._oldest: dict[tuple, int] = {}
        self._watchers: set[Watcher] = set()
        self.writes: list[dict] = []
        self.requests: list[dict] = []  # every resource request, reads included (RBAC audits)

    def next_resource_version(self) -> str:
        with self.lock:
            self.resource_version += 1
            return str(self.resource_version)

    def get(self, store_key, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self._objects[store_key].get((namespace or "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, store_key, namespace: str | None = None) -> list[dict]:
        with self.lock:
            items = [copy.deepcopy(o) for (ns, _), o in sorted(self._objects[store_key].items())
                     if namespace is None or ns == namespace]
            return items

    def all_keys(self) -> list[tuple]:
        with self.lock:
            return list(self._objects)

    def save(self, store_key, obj: dict, event_type: str) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        with self.lock:
            previous = self._objects[store_key].get(key)
            self._objects[store_key][key] = copy.deepcopy(obj)
            self._emit(store_key, event_type, obj, previous)

    def remove(self, store_key, obj: dict) -> None:
        meta = obj["metadata"]
        with self.lock:
            self._objects[store_key].pop((meta.get("namespace", ""), meta["name"]), None)
            self._emit(store_key, "DELETED", obj)

    def _emit(self, store_key, event_type: str, obj: dict, previous: dict | None = None) -> None:
        """Events are (resourceVersion, type, object, previous object or None)."""
        rv = int(obj["metadata"]["resourceVersion"])
        history = self._history[store_key]
        if len(history) == history.maxlen:
            self._oldest[store_key] = history[0][0]
        event = (rv, event_type, copy.deepcopy(obj), previous)
        history.append(event)
        for watcher in self._watchers:
            if watcher.store_key == store_key and watcher.namespace in (None, obj["metadata"].get("namespace")):
                watcher.push(event)

    def subscribe(self, store_key, namespace: str | None, since: int | None, loop) -> tuple[Watcher, list, bool]:
        """A watcher, the past events after `since` (None: none), and whether `since` is too old."""
        with self.lock:
            watcher = Watcher(store_key, namespace, loop)
            self._watchers.add(watcher)
            if since is None:
                return watcher, [], False
            too_old = since < self._oldest.get(store_key, 0)
            past = [e for e in self._history[store_key] if e[0] > since and
                    (namespace is None or e[2]["metadata"].get("namespace") == namespace)]
            return watcher, past, too_old

    def unsubscribe(self, watcher: Watcher) -> None:
        with self.lock:
            self._watchers.discard(watcher)

    def watcher_count(self) -> int:
        with self.lock:
            return len(self._watchers)

    def record_write(self, entry: dict) -> None:
        with self.lock:
            self.writes.append(entry)

    def clear_writes(self) -> None:
        with self.lock:
            self.writes.clear()

    def record_request(self, entry: dict) -> None:
        with self.lock:
            self.requests.append(entry)
