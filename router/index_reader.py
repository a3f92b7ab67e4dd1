"""The precise prefix lookup on the router's event loop: the same Lua script and keys as
``pdpool.kv_index.IndexReader.lookup``, one round trip, without handing each request to a thread and back (a
thread hop cost about 0.2 ms per request on the 2-core benchmark machine).

For a ``redis://`` URL the command goes through ``router/resp.py`` (about 0.17 -> 0.05 ms of CPU per lookup,
docs/performance.md); other URLs (``rediss://``, ``unix://``) through ``redis.asyncio``.

``start_mirror()`` (``--index-lookup mirror``, the default; ``redis://`` URLs) adds the router-local mirror
(``router/index_mirror.py``) on a second connection: ``PrefixIndex`` asks it first, and this Lua round trip
answers only when the mirror cannot (starting, re-reading after an outage, a node it has not read yet).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Sequence

import redis
import redis.asyncio as aioredis
from redis.connection import parse_url

from pdpool.kv_index import IndexUnavailableError, PoolKeys
from pdpool.kv_index.redis_index import LOOKUP_LUA
from pdpool.router.index_mirror import IndexMirror
from pdpool.router.resp import RespConnection, RespError, RespUnavailable

_LUA = LOOKUP_LUA.encode()
_SHA = hashlib.sha1(_LUA).hexdigest().encode()


class AsyncIndexReader:
    def __init__(self, url: str, password: str | None, keys: PoolKeys, timeout: float = 0.25) -> None:
        self.keys = keys
        self._prefix = keys.prefix.encode()
        self._nodes = keys.nodes.encode()
        self.conn: RespConnection | None = None
        self.client = None
        self.mirror: IndexMirror | None = None
        opts = parse_url(url)
        if "connection_class" not in opts and "host" in opts:   # plain TCP
            self.conn = RespConnection(opts["host"], opts.get("port", 6379), username=opts.get("username"),
                                       password=password if password is not None else opts.get("password"),
                                       db=opts.get("db", 0), timeout=timeout)
        else:
            self.client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout,
                                                  socket_connect_timeout=timeout, health_check_interval=0)
            self._script = self.client.register_script(LOOKUP_LUA)   # EVALSHA, falls back to EVAL once

    def start_mirror(self, **kw) -> IndexMirror | None:
        """Start tailing the nodes' event stream (on the running loop); None for a URL the lean client cannot
        reach (TLS, unix socket): lookups then stay on the Lua round trip."""
        if self.mirror is None:
            if self.conn is None:
                logging.getLogger("pdpool.router").info(
                    "index mirror needs a redis:// URL; the prefix lookup stays one Lua round trip per request")
                return None
            c = self.conn
            block_ms = kw.get("block_ms", 500)
            conn = RespConnection(c.host, c.port, username=c.username, password=c.password, db=c.db,
                                  timeout=max(c.timeout, block_ms / 1000 + 2.0))
            self.mirror = IndexMirror(conn, self.keys, **kw)
            self.mirror.start()
        return self.mirror

    async def lookup(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """``{node_id: leading blocks of block_hashes it holds}`` for every live node."""
        packed = b"".join(block_hashes)
        try:
            if self.conn is not None:
                flat = await self._lookup_resp(packed)
            else:
                flat = await self._script(keys=[self.keys.nodes], args=[self._prefix, packed])
        except (RespUnavailable, RespError, redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            raise IndexUnavailableError(f"block lookup failed: {exc}") from exc
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def _lookup_resp(self, packed: bytes) -> list:
        try:
            return await self.conn.call([b"EVALSHA", _SHA, b"1", self._nodes, self._prefix, packed])
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.conn.call([b"EVAL", _LUA, b"1", self._nodes, self._prefix, packed])  # caches it

    async def close(self) -> None:
        if self.mirror is not None:
            await self.mirror.close()
        if self.conn is not None:
            self.conn.close()
        if self.client is not None:
            await self.client.aclose()
