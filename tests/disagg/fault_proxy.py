"""A TCP proxy in front of a node that breaks one answer on purpose, as a flaky network or a sidecar would.

``FaultProxy(node_port, fault)`` listens on a free local port (``url``) and passes bytes both ways. ``Fault.arm(kind,
after)`` breaks the answer to the next ``POST /v1/...`` that reaches any proxy sharing that ``Fault`` (probes and
lease calls pass untouched), once:

    truncate   the node's first ``after`` bytes, then the connection closes (FIN)
    reset      the node's first ``after`` bytes, then a TCP reset (RST)
    garbage    ``after`` bytes that are no HTTP, then the connection closes
    rewrite    the answer passes whole, ``old`` bytes replaced by ``new`` (of the same length) in it

The node itself answers in full either way: it takes the answer as delivered.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading


class Fault:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: tuple | None = None
        self.fired = 0

    def arm(self, kind: str, after: int = 0) -> None:
        assert kind in ("truncate", "reset", "garbage"), kind
        with self._lock:
            self._armed = (kind, after)

    def arm_rewrite(self, old: bytes, new: bytes) -> None:
        assert len(old) == len(new), "the answer's Content-Length stays"
        with self._lock:
            self._armed = ("rewrite", (old, new))

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def take(self) -> tuple | None:
        with self._lock:
            armed, self._armed = self._armed, None
            if armed is not None:
                self.fired += 1
            return armed


class FaultProxy:
    def __init__(self, node_port: int, fault: Fault, host: str = "127.0.0.1") -> None:
        self.node = (host, node_port)
        self.fault = fault
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, host, 0))
            self.url = f"http://{host}:{self.server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            node_r, node_w = await asyncio.open_connection(*self.node)
        except OSError:
            _reset(client_w)
            return
        state = {"fault": None, "sent": 0}

        async def upstream() -> None:   # router -> node
            while data := await _read(client_r):
                if data.startswith(b"POST /v1/"):
                    state["fault"], state["sent"] = self.fault.take(), 0
                node_w.write(data)
                await node_w.drain()
            node_w.close()

        async def downstream() -> None:   # node -> router
            while data := await _read(node_r):
                fault = state["fault"]
                if fault is None:
                    client_w.write(data)
                    await client_w.drain()
                    continue
                kind, after = fault
                if kind == "rewrite":
                    client_w.write(data.replace(*after))
                    await client_w.drain()
                    continue
                if kind == "garbage":
                    client_w.write(bytes((i * 37 + 11) % 256 for i in range(after)))
                else:
                    client_w.write(data[:max(0, after - state["sent"])])
                state["sent"] += len(data)
                if kind == "garbage" or state["sent"] >= after:
                    await client_w.drain()
                    _reset(client_w) if kind == "reset" else client_w.close()
                    node_w.close()
                    return
            client_w.close()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(tasks, timeout=60)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            node_w.close()
            client_w.close()

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _read(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(65536)
    except OSError:
        return b""


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
