"""Prefill peers' NIXL agents, loaded lazily per (node id, incarnation).

The metadata comes from Redis (``nixl:<node>:<incarnation>``, via ``IndexReader``); when Redis is down or
does not have it, from the peer itself (``GET /internal/kv/agent``), which answers for its *current*
incarnation only. A handle whose incarnation is not the one found is stale (the prefill node restarted):
``StaleHandleError``, and nothing is read from the new agent. Loading a peer and its connection warm-up run in a
thread, off the event loop.

The handle names the address to call (``remote_host``, ``remote_port``), and the call carries this node's internal
token. ``vouch`` is asked before any call: where Redis is reachable, the address must be the one the named node
heartbeats (``hb:<node>``), else ``UnknownPeerError`` and nothing is sent, so an edited or forged handle never gets
the token sent to an address of its choosing. Where Redis is not set or down, the handle is taken as it is (the pool
keeps serving without Redis).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp

from pdpool import internal_api
from pdpool.kv_transfer.agent import KVTransferError, unpack_metadata
from pdpool.kv_transfer.handle import KVHandle
from pdpool.utils import http_url

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRef:
    """A lease and its prefill node's address: what a release needs of a handle (``KVHandle`` has these fields)."""
    node_id: str
    remote_host: str
    remote_port: int
    lease_id: str

    @classmethod
    def of(cls, params: dict) -> "LeaseRef | None":
        """From ``kv_transfer_params`` that are no valid handle, if they still name a lease and an address."""
        ref = cls(*(params.get(name) for name in ("node_id", "remote_host", "remote_port", "lease_id")))
        port = ref.remote_port
        if (all(isinstance(v, str) and v for v in (ref.node_id, ref.remote_host, ref.lease_id))
                and type(port) is int and 1 <= port <= 65535):
            return ref
        return None


class PeerUnavailableError(RuntimeError):
    """The prefill node's agent metadata could not be had."""


class StaleHandleError(PeerUnavailableError):
    """The handle names an incarnation of the prefill node that is gone."""


class UnknownPeerError(PeerUnavailableError):
    """The handle's address is not where the pool's index has the node it names."""


class PeerDirectory:
    def __init__(self, worker, *, reader=None, session_of, token: str | None, timeout: float) -> None:
        """``worker``: the node's ``KVWorker``; None where it only releases leases (a node still loading, or one
        with no decode side: ``Node._release_handle``)."""
        self.worker = worker
        self.reader = reader          # pdpool.kv_index IndexReader, or None without Redis
        self.session_of = session_of  # () -> aiohttp.ClientSession
        self.token = token
        self.timeout = timeout
        self.loaded: dict[str, tuple[str, str]] = {}  # node id -> (incarnation, agent name)
        self.num_fetches = 0
        self._locks: dict[str, asyncio.Lock] = {}  # node id -> one load at a time
        self._vouched: set[tuple[str, str, int]] = set()  # (node id, host, port) the index confirmed

    async def vouch(self, handle) -> None:
        """Raise ``UnknownPeerError`` unless the index has the handle's node at the handle's address (or cannot
        say: no Redis, or Redis down). ``handle``: a ``KVHandle``, or anything with its ``node_id``, ``remote_host``
        and ``remote_port`` (``decode_node.side.LeaseRef``)."""
        peer = (handle.node_id, handle.remote_host, handle.remote_port)
        if self.reader is None or peer in self._vouched:
            return
        try:
            info = await asyncio.get_running_loop().run_in_executor(None, self.reader.heartbeat, handle.node_id)
        except Exception as exc:  # IndexUnavailableError: the handle is taken as it is
            logger.info("could not check node %s's address in Redis (%s); trusting the handle", handle.node_id, exc)
            return
        address = http_url(handle.remote_host, handle.remote_port)
        if info is None or info.url != address:
            raise UnknownPeerError(f"the pool's index has no node {handle.node_id!r} at {address} "
                                   f"({'no live node of that id' if info is None else 'it is at ' + info.url})")
        self._vouched.add(peer)

    async def post(self, h: KVHandle | LeaseRef, action: str, body: dict) -> dict:
        """``POST /internal/kv/leases/{lease}/{action}`` at the lease's prefill node, its address vouched for first;
        the reply. Raises ``KVTransferError`` (``UnknownPeerError`` for an address the index does not vouch for)."""
        url = internal_api.url(h.remote_host, h.remote_port, f"kv/leases/{quote(h.lease_id, safe='')}/{action}")
        await self.vouch(h)
        try:
            async with self.session_of().post(url, json=body, headers=internal_api.headers(self.token),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                reply = await resp.json(content_type=None)
                if resp.status != 200:
                    raise KVTransferError(f"{action} at {h.node_id} answered {resp.status}: {reply}")
                return reply
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise KVTransferError(f"{action} at {h.node_id} failed: {exc!r}") from exc

    async def release(self, lease: KVHandle | LeaseRef) -> None:
        """Best effort: tell the prefill node to free the lease's blocks now rather than at expiry."""
        try:
            await self.post(lease, "notify", {"release": True})
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            logger.info("could not release lease %s at %s: %s", lease.lease_id, lease.node_id, exc)

    async def agent(self, handle: KVHandle) -> str:
        """The NIXL peer name of the handle's agent, its metadata loaded."""
        await self.vouch(handle)
        async with self._locks.setdefault(handle.node_id, asyncio.Lock()):
            return await self._agent(handle)

    async def _agent(self, handle: KVHandle) -> str:
        known = self.loaded.get(handle.node_id)
        if known is not None and known[0] == handle.incarnation:
            return known[1]
        metadata = await self._fetch(handle)
        name, _, _ = unpack_metadata(metadata)
        if name != handle.agent_name:
            raise StaleHandleError(f"agent of node {handle.node_id} is {name}, the handle names {handle.agent_name}")
        # Loading drops the node's other incarnation (KVAgent.add_peer): forget it first, so that a load that fails
        # leaves no entry naming an agent that is gone.
        self.loaded.pop(handle.node_id, None)
        # NIXL loads the metadata (dropping an earlier incarnation's agent) and UCX connects and warms up (tens of
        # ms): in a thread, not on the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self._add_and_warm, metadata, name)
        self.loaded[handle.node_id] = (handle.incarnation, name)
        return name

    def forget(self, agent_name: str) -> None:
        """The agent was removed (``PeerSweeper``: its node left the pool): the next handle of its node loads it
        again, and what was kept about the node goes."""
        for node, (_, name) in list(self.loaded.items()):
            if name == agent_name:
                del self.loaded[node]
                lock = self._locks.get(node)
                if lock is not None and not lock.locked():
                    del self._locks[node]
                self._vouched = {v for v in self._vouched if v[0] != node}

    def _add_and_warm(self, metadata: bytes, name: str) -> None:
        self.worker.add_peer(metadata)
        self.worker.agent.warm_up(name, self.timeout)

    def _from_index(self, handle: KVHandle) -> tuple[bytes | None, str | None]:
        """The handle's agent metadata in Redis, and the incarnation the node heartbeats now (None: not live). An
        incarnation killed without deregistering keeps its metadata there a while after its successor started."""
        md = self.reader.agent_metadata(handle.node_id, handle.incarnation)
        info = self.reader.heartbeat(handle.node_id) if md is not None else None
        return md, None if info is None else info.incarnation

    async def _fetch(self, handle: KVHandle) -> bytes:
        self.num_fetches += 1
        if self.reader is not None:
            try:
                md, live = await asyncio.get_running_loop().run_in_executor(None, self._from_index, handle)
                if md is not None:
                    if live is not None and live != handle.incarnation:
                        raise StaleHandleError(f"prefill node {handle.node_id} is now incarnation {live}; the "
                                               f"handle is from {handle.incarnation}")
                    return md
            except StaleHandleError:
                raise
            except Exception as exc:  # IndexUnavailableError: ask the peer itself
                logger.info("agent metadata of %s not in Redis (%s); asking the node", handle.node_id, exc)
        try:
            url = internal_api.url(handle.remote_host, handle.remote_port, "kv/agent")
            async with self.session_of().get(url, headers=internal_api.headers(self.token),
                                             timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise PeerUnavailableError(f"{url} answered {resp.status}")
                body = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerUnavailableError(f"prefill node {handle.node_id} unreachable: {exc!r}") from exc
        if body.get("incarnation") != handle.incarnation:
            raise StaleHandleError(f"prefill node {handle.node_id} is now incarnation {body.get('incarnation')}; "
                                   f"the handle is from {handle.incarnation}")
        return base64.b64decode(body["agent_metadata"])
