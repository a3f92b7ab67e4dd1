"""One NIXL agent per node: registers the KV cache once and moves whole blocks to and from peers.

The worker side of KV transfer (the engine decides *what* to move; this moves bytes)::

    agent = KVAgent("node-a#3f2c", ucx_tls="tcp,self")
    agent.register_kv_cache(kv_cache)                 # [num_blocks, num_layers, 2, block_size, H, D]
    md = agent.metadata()                             # bytes: our KV region + NIXL's agent metadata
    peer = other.add_peer(md)                         # lazy: no connection yet
    other.read_blocks(peer, remote_block_ids=[4, 5, 9], local_block_ids=[0, 1, 2], notif=b"req-1")  # pull
    other.write_blocks(peer, remote_block_ids=[...], local_block_ids=[...], notif=b"req-2")          # push
    agent.get_notifs()                                # {peer_name: [b"req-1", ...]}

A block is one contiguous byte range, so a run of adjacent block ids is one descriptor (``layout.descriptors``).
The first transfer to a peer is preceded by a warm-up (connect + a 64-byte READ) so the real one does not pay the
connection set-up. Every wait is bounded and raises ``KVTransferError``. ``start_read``/``start_write`` return a
``PendingTransfer`` that an asyncio loop can await (``await t.wait_async(timeout)``) without blocking. A wait that
is cancelled waits the transfer out (to its deadline) before the cancellation goes on, so a caller that sees it may
reuse the blocks.

A peer is never removed while it is in use: a transfer with it posted and not ended, or a caller's hold
(``with agent.using(peer):`` around a handoff's load, warm-up and transfer). ``remove_idle_peers`` removes the others
that a predicate names (``peer_sweep.PeerSweeper``: the peers whose node left the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdpool.kv_transfer.layout import KVRegion, descriptors, region_of

logger = logging.getLogger(__name__)

_MD_MAGIC = b"PDKV"
_MD_VERSION = 1
_WARMUP_BYTES = 64
# A transfer is polled at intervals of 1/32 of the time waited so far, so waiting adds about 3 % to it: a
# same-host GPU transfer of 128 MiB ends in about 0.4 ms, which a fixed 0.5 ms sleep would more than double.
# Intervals too short to sleep spin instead: under 50 us (time.sleep's own slack), and under 1 ms in asyncio
# (its epoll rounds every sleep up to a whole millisecond), where the loop yields to other tasks meanwhile.
_POLL_S = 0.0005
_SPIN_S = 50e-6
_ASYNC_POLL_S = 0.002
_ASYNC_SPIN_S = 0.001


def _poll_interval(waited_s: float, longest_s: float) -> float:
    return min(longest_s, waited_s / 32)


class KVTransferError(RuntimeError):
    """A KV transfer failed or did not finish in time."""


# NIXL's progress thread sleeps this long between rounds when nothing is pending. The Python API hard-codes 0,
# and then the thread polls UCX without pause: one idle agent burned 99% of a core, so every pool node held a
# core busy doing nothing (on a 2-core host, all of it). The thread only serves what no caller polls for (a
# passive peer's side of emulated RMA over TCP, notifications); the active side progresses its own transfers in
# check_xfer_state. NIXL's unit is microseconds.
PROGRESS_THREAD_DELAY_US = 100


def _import_nixl():
    """nixl_cu13 on CUDA 13 hosts, nixl_cu12 on CUDA 12 / CPU, or the source-built ``nixl``."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            mod = __import__(f"{name}._api", fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError:
            continue
        return mod.nixl_agent, mod.nixl_agent_config, mod.nixlBind
    raise KVTransferError("NIXL is not installed (pip install nixl-cu12, or nixl-cu13 on CUDA 13)")


def _new_nixl_agent(name: str):
    """A NIXL agent with no backend yet, whose progress thread sleeps ``PROGRESS_THREAD_DELAY_US`` between idle
    rounds. ``nixl_agent`` builds its C++ config itself and sets the delay to 0; the C++ agent reads the config
    once, in its constructor, so the config is built here with a class that keeps our delay."""
    nixl_agent, nixl_agent_config, bindings = _import_nixl()
    base = bindings.nixlAgentConfig

    class _Config(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_THREAD_DELAY_US if key == "pthrDelay" else value)

    bindings.nixlAgentConfig = _Config
    try:
        return nixl_agent(name, nixl_agent_config(backends=[]))
    finally:
        bindings.nixlAgentConfig = base


def node_of(agent_name: str) -> str | None:
    """The node id of an agent named ``<node_id>#<incarnation>`` (``KVAgent.from_config``); None for another name."""
    node, sep, _ = agent_name.rpartition("#")
    return node if sep else None


def pack_metadata(agent_name: str, regions: Sequence[KVRegion], nixl_md: bytes) -> bytes:
    """``PDKV | u8 version | u32 header length | header JSON | NIXL agent metadata``."""
    header = json.dumps({"agent_name": agent_name, "regions": [r.to_dict() for r in regions]}).encode()
    return _MD_MAGIC + struct.pack("<BI", _MD_VERSION, len(header)) + header + nixl_md


def unpack_metadata(data: bytes) -> tuple[str, list[KVRegion], bytes]:
    if data[:4] != _MD_MAGIC:
        raise KVTransferError("peer metadata is not pdpool KV agent metadata")
    version, n = struct.unpack_from("<BI", data, 4)
    if version != _MD_VERSION:
        raise KVTransferError(f"peer metadata version {version}, this node speaks {_MD_VERSION}")
    header = json.loads(data[9:9 + n])
    return header["agent_name"], [KVRegion.from_dict(r) for r in header["regions"]], data[9 + n:]


@dataclass
class TransferStats:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    descriptors: int = 0
    failures: int = 0
    warmups: int = 0


@dataclass
class _Peer:
    name: str
    regions: list[KVRegion]
    metadata: bytes
    loaded: bool = True   # NIXL holds its metadata (False after a forced disconnect)
    warm: bool = False
    last_used: float = field(default_factory=time.monotonic)  # when its last use ended (or it was loaded)


@dataclass
class PendingTransfer:
    """One posted transfer. ``poll()`` never blocks; ``wait``/``wait_async`` are bounded by a timeout."""
    agent: "KVAgent"
    handle: object
    op: str
    peer: str
    nbytes: int
    num_descs: int
    started: float = field(default_factory=time.perf_counter)
    counted: bool = True     # False for the warm-up, which moves no KV
    done: bool = False
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        self.agent._hold(self.peer)  # in flight until done: the peer is not removed meanwhile

    def poll(self) -> bool:
        if self.done:
            return True
        state = self.agent._nixl.check_xfer_state(self.handle)
        if state == "DONE":
            self._finish()
            return True
        if state == "ERR":
            self._fail(f"NIXL {self.op} to {self.peer} failed")
        return False

    def _next_poll(self, deadline: float, timeout: float, longest_s: float) -> float | None:
        """None once done; else how long to wait before polling again. Raises past the deadline."""
        if self.poll():
            return None
        now = time.perf_counter()
        if now > deadline:
            self._fail(f"NIXL {self.op} of {self.nbytes} B with {self.peer} timed out after {timeout:.3g}s")
        return _poll_interval(now - self.started, longest_s)

    def wait(self, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        try:
            while (interval := self._next_poll(deadline, timeout, _POLL_S)) is not None:
                if interval >= _SPIN_S:
                    time.sleep(interval)
        except BaseException:  # KeyboardInterrupt included: the transfer must not outlive the wait
            self.abort()
            raise
        return self.elapsed_s

    async def wait_async(self, timeout: float) -> float:
        """A cancelled wait (``asyncio.wait_for``, an abort) first waits the transfer out, up to this wait's own
        deadline, and only then lets the cancellation go on: a caller that sees it may reuse the blocks."""
        deadline = time.perf_counter() + timeout
        try:
            while (interval := self._next_poll(deadline, timeout, _ASYNC_POLL_S)) is not None:
                await asyncio.sleep(interval if interval >= _ASYNC_SPIN_S else 0)
        except asyncio.CancelledError:
            try:
                await self._wait_out(deadline)
            finally:
                self.abort()
            raise
        except BaseException:
            self.abort()
            raise
        return self.elapsed_s

    async def _wait_out(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            try:
                if self.poll():
                    return
            except KVTransferError:  # it ended in error: nothing more lands
                return
            await asyncio.sleep(_ASYNC_POLL_S)

    def abort(self) -> None:
        """Give up a transfer that is not done: release its NIXL request and disconnect the peer (the next
        transfer reconnects). A no-op once done.

        This does not always stop it: with UCX over TCP, a READ whose peer answers after the release still lands
        (tests/disagg/test_transfer_cancel.py), so callers wait a transfer out (``wait_async`` does on
        cancellation) and abort only past their deadline."""
        if self.done:
            return
        self.done = True
        self.agent._unhold(self.peer)
        self.agent.stats.failures += 1
        logger.warning("NIXL %s of %d B with %s given up in flight; it may still land in its blocks", self.op,
                       self.nbytes, self.peer)
        self.agent._release(self.handle)
        self.agent._disconnect(self.peer)

    def _finish(self) -> None:
        self.done = True
        self.agent._unhold(self.peer)
        self.elapsed_s = time.perf_counter() - self.started
        self.agent._release(self.handle)
        if not self.counted:
            return
        stats = self.agent.stats
        stats.descriptors += self.num_descs
        if self.op == "READ":
            stats.bytes_read += self.nbytes
            stats.reads += 1
        else:
            stats.bytes_written += self.nbytes
            stats.writes += 1

    def _fail(self, message: str) -> None:
        self.abort()
        raise KVTransferError(message)


class KVAgent:
    """The node's NIXL agent (UCX backend). Not thread-safe: drive it from one thread or one event loop."""

    def __init__(self, name: str, *, ucx_tls: str | None = None, ucx_net_devices: str | None = None,
                 num_threads: int = 0, split_batch_size: int | None = None) -> None:
        """``num_threads`` > 0 gives NIXL's UCX backend that many worker threads, which post the descriptors of
        a transfer of at least ``split_batch_size`` descriptors (NIXL's default 1024) in parallel chunks."""
        # UCX reads its environment when the NIXL UCX backend creates its context, i.e. right below.
        if ucx_tls:
            os.environ["UCX_TLS"] = ucx_tls
        if ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = ucx_net_devices
        self.name = name
        params = {"num_threads": str(num_threads)} if num_threads > 0 else {}
        if num_threads > 0 and split_batch_size:
            params["split_batch_size"] = str(split_batch_size)
        try:
            self._nixl = _new_nixl_agent(name)
            self._nixl.create_backend("UCX", params)
        except Exception as exc:  # UCX refuses e.g. UCX_TLS=sm,self: its wire-up needs tcp (or ib)
            raise KVTransferError(f"NIXL UCX backend failed to start (UCX_TLS={os.environ.get('UCX_TLS')}): "
                                  f"{exc}") from exc
        if "UCX" not in self._nixl.backends:
            raise KVTransferError("NIXL has no UCX backend on this host")
        self._region: KVRegion | None = None
        self._scratch = None      # small registered buffer for warm-up reads
        self._reg_descs: list = []
        self._peers: dict[str, _Peer] = {}
        # Per peer name: transfers posted and not ended, plus the callers' holds (``using``). A peer with any is
        # never removed. Counted from the event loop and from the threads that load and warm up peers.
        self._in_use: dict[str, int] = {}
        self._in_use_lock = threading.Lock()
        self.stats = TransferStats()
        # NIXL does not report which UCX transport carried a transfer; UCX_PROTO_INFO=y makes UCX print
        # its per-operation selection (e.g. "remote memory read by ucp_get* ... tcp/lo" or "cma/memory").
        logger.info("NIXL agent %s: backend UCX, UCX_TLS=%s, UCX_NET_DEVICES=%s", name,
                    os.environ.get("UCX_TLS", "<all>"), os.environ.get("UCX_NET_DEVICES", "<all>"))

    @classmethod
    def from_config(cls, disagg, node_id: str, incarnation: str) -> "KVAgent":
        """From ``DisaggConfig`` (UCX_TLS, UCX_NET_DEVICES); the agent is named ``<node_id>#<incarnation>``."""
        return cls(f"{node_id}#{incarnation}", ucx_tls=disagg.ucx_tls, ucx_net_devices=disagg.ucx_net_devices)

    # ---- registration and metadata -------------------------------------------------------------

    @property
    def region(self) -> KVRegion:
        if self._region is None:
            raise KVTransferError("register_kv_cache() first")
        return self._region

    def register_kv_cache(self, kv_cache) -> KVRegion:
        """Register the node's KV tensor (once). Host memory registers as DRAM, CUDA memory as VRAM."""
        import torch

        if self._region is not None:
            raise KVTransferError("the KV cache is already registered")
        region = region_of(kv_cache)
        self._scratch = torch.zeros(_WARMUP_BYTES, dtype=torch.uint8, device=kv_cache.device)
        for tensor in (kv_cache, self._scratch):
            self._reg_descs.append(self._nixl.register_memory(
                [(tensor.data_ptr(), tensor.numel() * tensor.element_size(), region.device_id, "")],
                mem_type=region.mem_type))
        self._kv_cache = kv_cache  # keep the registered memory alive
        self._region = region
        logger.info("NIXL agent %s registered %d blocks x %d B (%s)", self.name, region.num_blocks,
                    region.block_bytes, region.mem_type)
        return region

    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer``: our KV region and NIXL's agent metadata."""
        return pack_metadata(self.name, [self.region], self._nixl.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (idempotent). The connection is made lazily, on the first transfer.

        One incarnation of a node lives at a time: loading ``<node>#<incarnation>`` drops the agent of any other
        incarnation of that node, so a node whose peers restart keeps one agent per peer, not one per restart."""
        name, regions, nixl_md = unpack_metadata(metadata)
        known = self._peers.get(name)
        if known is not None and known.metadata == metadata:
            return name
        if known is not None:
            self._disconnect(name)
        node = node_of(name)
        for other in [p for p in list(self._peers) if p != name and node is not None and node_of(p) == node]:
            if not self.in_use(other):  # one in use goes at a later sweep (remove_idle_peers), once idle
                self.remove_peer(other)
        loaded = self._nixl.add_remote_agent(nixl_md)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise KVTransferError(f"peer metadata names agent {name!r} but NIXL loaded {loaded!r}")
        self._peers[name] = _Peer(name, regions, metadata)
        return name

    def remove_peer(self, peer: str) -> None:
        self._disconnect(peer)
        self._peers.pop(peer, None)

    @property
    def peers(self) -> list[str]:
        """The names of the peers whose metadata is loaded (or will be reloaded at their next transfer)."""
        return list(self._peers)

    @contextlib.contextmanager
    def using(self, peer: str):
        """Hold ``peer`` for the block (its load, warm-up and transfers): ``remove_idle_peers`` leaves it alone. The
        name may be held before its metadata is loaded."""
        self._hold(peer)
        try:
            yield peer
        finally:
            self._unhold(peer)

    def in_use(self, peer: str) -> int:
        """Transfers with ``peer`` in flight plus the holds on it (``using``)."""
        return self._in_use.get(peer, 0)

    def idle_seconds(self, peer: str) -> float:
        """Seconds since ``peer`` was last in use or loaded; 0 while in use."""
        known = self._peers.get(peer)
        if known is None or self.in_use(peer):
            return 0.0
        return time.monotonic() - known.last_used

    def remove_idle_peers(self, gone: Callable[[str], bool]) -> list[str]:
        """Remove every peer that is not in use and ``gone(name)`` says has left; the removed names. A peer with a
        transfer in flight or queued (``using``) stays, to be removed at a later call once idle. Call from the
        thread that holds peers (the event loop), so that no hold is taken between the check and the removal."""
        removed = []
        for name in list(self._peers):
            if self.in_use(name) or not gone(name):
                continue
            self.remove_peer(name)
            removed.append(name)
        return removed

    def _hold(self, peer: str) -> None:
        with self._in_use_lock:
            self._in_use[peer] = self._in_use.get(peer, 0) + 1

    def _unhold(self, peer: str) -> None:
        with self._in_use_lock:
            left = self._in_use.get(peer, 0) - 1
            if left > 0:
                self._in_use[peer] = left
            else:
                self._in_use.pop(peer, None)
            known = self._peers.get(peer)
            if known is not None:
                known.last_used = time.monotonic()

    def peer_region(self, peer: str, rank: int = 0) -> KVRegion:
        try:
            return self._peers[peer].regions[rank]
        except KeyError:
            raise KVTransferError(f"unknown peer {peer!r}: add_peer() its metadata first") from None

    # ---- transfers ---------------------------------------------------------------------------

    def start_read(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                   notif: bytes = b"", timeout: float = 10.0) -> PendingTransfer:
        """Post a READ of the peer's blocks into ours (pull). ``notif`` reaches the peer when it is done."""
        return self._start("READ", peer, remote_block_ids, local_block_ids, notif, timeout)

    def start_write(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    notif: bytes = b"", timeout: float = 10.0) -> PendingTransfer:
        """Post a WRITE of our blocks into the peer's (push)."""
        return self._start("WRITE", peer, remote_block_ids, local_block_ids, notif, timeout)

    def read_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    notif: bytes = b"", timeout: float = 10.0) -> float:
        """READ and wait; returns seconds the transfer took. Raises ``KVTransferError``."""
        return self.start_read(peer, remote_block_ids, local_block_ids, notif, timeout).wait(timeout)

    def write_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                     notif: bytes = b"", timeout: float = 10.0) -> float:
        """WRITE and wait; returns seconds the transfer took. Raises ``KVTransferError``."""
        return self.start_write(peer, remote_block_ids, local_block_ids, notif, timeout).wait(timeout)

    def send_notif(self, peer: str, message: bytes) -> None:
        self._nixl.send_notif(peer, message)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call: ``{peer agent name: [message, ...]}``."""
        return dict(self._nixl.get_new_notifs())

    def wait_notif(self, peer: str | None, message: bytes, timeout: float) -> None:
        """Block until ``message`` arrives (from ``peer``, or from anyone); other messages are kept."""
        deadline = time.perf_counter() + timeout
        while True:
            if self._take_notif(peer, message):
                return
            if time.perf_counter() > deadline:
                raise KVTransferError(f"notification {message!r} not received within {timeout:.3g}s")
            time.sleep(_POLL_S)

    def _take_notif(self, peer: str | None, message: bytes) -> bool:
        for name, msgs in self._nixl.update_notifs().items():
            if (peer is None or name == peer) and message in msgs:
                msgs.remove(message)
                return True
        return False

    def _start(self, op: str, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int],
               notif: bytes, timeout: float) -> PendingTransfer:
        remote = self.peer_region(peer)
        local_descs, remote_descs = descriptors(self.region, remote, local_ids, remote_ids)
        if not local_descs:
            raise KVTransferError("nothing to transfer: no block ids")
        if not self._peers[peer].loaded:
            self._nixl.add_remote_agent(unpack_metadata(self._peers[peer].metadata)[2])
            self._peers[peer].loaded = True
        if not self._peers[peer].warm:
            self.warm_up(peer, timeout)
        nbytes = sum(d[1] for d in local_descs)
        posted = time.perf_counter()  # the clock starts before the post: transfer() may move small payloads inline
        handle = self._post(op, peer, local_descs, remote_descs, notif, remote.mem_type)
        return PendingTransfer(self, handle, op, peer, nbytes, len(local_descs), started=posted)

    def _post(self, op: str, peer: str, local_descs, remote_descs, notif: bytes, remote_mem: str):
        nixl = self._nixl
        handle = None
        try:
            handle = nixl.initialize_xfer(op, nixl.get_xfer_descs(local_descs, self.region.mem_type),
                                          nixl.get_xfer_descs(remote_descs, remote_mem), peer, notif)
            state = nixl.transfer(handle)
        except Exception as exc:  # nixlBind raises its own types (nixlNotFoundError, nixlBackendError...)
            self.stats.failures += 1
            if handle is not None:  # made, then refused at post (a peer that disconnected): not left in NIXL
                self._release(handle)
            if peer in self._peers:
                self._peers[peer].warm = False  # reconnect (and warm up) on the next attempt
            raise KVTransferError(f"NIXL {op} with {peer} could not be posted: {exc}") from exc
        if state == "ERR":
            self.stats.failures += 1
            self._release(handle)
            raise KVTransferError(f"NIXL {op} with {peer} failed at post")
        return handle

    def warm_up(self, peer: str, timeout: float = 10.0) -> None:
        """Connect and READ 64 bytes, so the first real transfer does not pay the UCX wire-up.

        The first transfer to a peer does this itself, blocking for the set-up (tens of ms); a caller on an
        event loop can instead run it ahead in a thread (``await asyncio.to_thread(agent.warm_up, peer)``).
        """
        remote = self.peer_region(peer)
        t0 = time.perf_counter()
        try:
            self._nixl.make_connection(peer)
        except Exception as exc:
            raise KVTransferError(f"cannot connect to peer {peer}: {exc}") from exc
        local = [(self._scratch.data_ptr(), _WARMUP_BYTES, self.region.device_id)]
        far = [(remote.base_addr, _WARMUP_BYTES, remote.device_id)]
        handle = self._post("READ", peer, local, far, b"", remote.mem_type)
        backend = self._nixl.query_xfer_backend(handle)
        PendingTransfer(self, handle, "warm-up READ", peer, _WARMUP_BYTES, 1, counted=False).wait(timeout)
        self.stats.warmups += 1
        self._peers[peer].warm = True
        logger.info("NIXL agent %s connected to %s in %.1f ms via %s (UCX_TLS=%s)", self.name, peer,
                    (time.perf_counter() - t0) * 1e3, backend, os.environ.get("UCX_TLS", "<all>"))

    def _release(self, handle) -> bool:
        try:
            self._nixl.release_xfer_handle(handle)
            return True
        except Exception as exc:  # a transfer NIXL could not cancel: its handle stays in NIXL's leak list
            logger.warning("NIXL could not release a transfer handle: %s", exc)
            self._nixl._leaked_xfer_handles.append(handle._handle)
            handle._released = True
            return False

    def _disconnect(self, peer: str) -> None:
        known = self._peers.get(peer)
        if known is None or not known.loaded:
            return
        try:
            self._nixl.remove_remote_agent(peer)
        except Exception as exc:
            logger.debug("remove_remote_agent(%s): %s", peer, exc)
        known.loaded = known.warm = False

    def close(self) -> None:
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except Exception as exc:
                logger.debug("remove_peer(%s): %s", peer, exc)
        for descs in self._reg_descs:
            try:
                self._nixl.deregister_memory(descs)
            except Exception as exc:
                logger.debug("deregister_memory: %s", exc)
        self._reg_descs.clear()
