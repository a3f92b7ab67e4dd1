"""A fast stub OpenAI upstream for the router overhead benchmark: answers at once, optionally heartbeats into
Redis as a pdpool node (role both) so the router's Redis discovery and precise prefix lookup run as in a pool.

    python benchmarks/router_stub_upstream.py --port 9001 [--redis redis://127.0.0.1:6379/0 --node-id stub-1]
                                              [--pool bench] [--kv-blocks 4096] [--step-ms 10]

With ``--redis`` the stub also keeps a prefix cache the way a node does and publishes it the way a node does:
the engines' block hashes of every prompt the router sends with ``pdpool_prompt_token_ids`` (model "demo",
float32, block size 16; a block already seen under the same parent is looked up by its ids' text, not parsed
and hashed again: ``BlockHasher``), held in an LRU of ``--kv-blocks`` blocks, each request's new and evicted blocks handed to
``NodeIndex.publish`` once per ``--step-ms`` (10 ms), as an engine publishes once per step, not once per request
(so Redis's sets and the index event stream the routers' mirrors tail change as with real nodes; before round 6
of the overhead work each request's blocks went out in a MULTI of their own, 5x the Redis transactions of a
node at 1000 req/s). Since round 9 a served prompt's blocks are hashed and stored at that step too, not right
after its answer is written (``--index-work step``, the default; ``response`` is the earlier way): an engine
stores a step's blocks after the step, and on the shared 2-core machine the moment after an answer is the
request's critical path, where the emulated node's hashing delayed the router and the load generator. A request without those ids (the direct baseline, the peers) costs nothing more: what the
stubs cost per request under each router is in ``router_overhead.py``'s output.

A raw asyncio protocol on httptools (llhttp), on uvloop when installed: every answer is a canned one, written from
the parser's callback, so the stub costs the shared 2-core machine as little CPU as it can (it was aiohttp before
round 4 of the overhead work; the same stub serves every router measured and the direct baseline). Keep-alive
and pipelined requests are answered in order; bodies of any framing are read and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import OrderedDict

import httptools

BODY = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "demo",
                   "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                   "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001,
                             "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
OK = json.dumps({"status": "ok"}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "demo", "object": "model", "owned_by": "stub"}]}).encode()
GET = {"/health": OK, "/health/ready": OK, "/health/live": OK, "/health_generate": OK, "/readiness": OK,
       "/liveness": OK, "/get_server_info": OK, "/get_model_info": OK, "/v1/models": MODELS}
POST = {"/v1/completions": BODY, "/v1/chat/completions": BODY}


def answer(status: int, body: bytes, keep_alive: bool) -> bytes:
    reason = {200: "OK", 404: "Not Found"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{'' if keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n").encode() + body


CANNED = {(method, path, keep): answer(200, body, keep) for method, table in (("GET", GET), ("POST", POST))
          for path, body in table.items() for keep in (True, False)}


IDS_KEY = b'"pdpool_prompt_token_ids":'


class BlockHasher:
    """The engines' block hashes of a forwarded body's token ids, memoized by each block's ids as they appear in
    the JSON text (with the parent hash), so the shared system prompt's ids are neither parsed nor hashed again
    for every request: what a node's prefix cache does for a prefix it holds. Exact: a block not in the memo is
    hashed by ``extend_block_hashes`` from its parsed ids; a body that is not one flat list of ids (several
    prompts, other spacing) goes through ``json`` and ``hash_prompt_blocks``."""

    def __init__(self, block_size: int, root: bytes, capacity: int = 200_000) -> None:
        self.block_size = block_size
        self.root = root
        self.capacity = capacity
        self.memo: dict[tuple[bytes, bytes], bytes] = {}

    def prompts(self, body: bytes) -> list[list[bytes]]:
        from pdpool.block_hash import hash_prompt_blocks

        text = body[body.rfind(IDS_KEY) + len(IDS_KEY):].rstrip().rstrip(b"}").strip()
        if text.startswith(b"[[") and text.endswith(b"]]") and b"]" not in text[2:-2] and b" " not in text:
            return [self.hashes(text[2:-2].split(b","))]
        return [hash_prompt_blocks(ids, self.block_size, self.root)
                for ids in json.loads(body)["pdpool_prompt_token_ids"]]

    def hashes(self, parts: list[bytes]) -> list[bytes]:
        from pdpool.block_hash import extend_block_hashes

        bs, memo = self.block_size, self.memo
        out: list[bytes] = []
        parent = self.root
        end = len(parts) // bs * bs
        for start in range(0, end, bs):
            h = memo.get((parent, b",".join(parts[start:start + bs])))
            if h is None:   # this block and every later one: from their ids (bs leading dummies stand for ``out``)
                new = extend_block_hashes([parent], [0] * bs + [int(p) for p in parts[start:end]], bs, self.root)[1:]
                if len(memo) + len(new) > self.capacity:
                    memo.clear()
                for j, h in enumerate(new):
                    memo[(parent, b",".join(parts[start + j * bs:start + (j + 1) * bs]))] = h
                    parent = h
                return out + new
            out.append(h)
            parent = h
        return out


class PrefixCache:
    """A node's prefix cache as the index sees it: block hashes in LRU order, ``capacity`` blocks. Its changes are
    published once per ``step`` seconds, as an engine publishes once per step (``KVConnector.after_step``); 0
    publishes each request's changes on their own."""

    def __init__(self, index, capacity: int, step: float = 0.0, at_step: bool = True) -> None:
        from pdpool.block_hash import ModelFingerprint, root_hash

        self.index = index
        self.capacity = capacity
        self.step = step
        self.root = root_hash(ModelFingerprint("demo", "float32", 16))
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.hasher = BlockHasher(16, self.root)
        self.touched: set[bytes] = set()      # stored or evicted since the last publish
        self.flush_at: asyncio.TimerHandle | None = None
        self.at_step = at_step and step > 0
        self.queued: list[bytes] = []         # served bodies whose blocks are not stored yet (``at_step``)

    def served(self, body: bytes) -> None:
        """A body was answered. With ``at_step`` its blocks are hashed and stored at the next publish step, as an
        engine stores a step's blocks after that step and not at the moment the router relays an answer (on the
        shared 2-core machine that moment is the request's critical path); else at once, as before round 9."""
        if IDS_KEY not in body:
            return
        if self.at_step:
            self.queued.append(body)
            if self.flush_at is None:
                self.flush_at = asyncio.get_running_loop().call_later(self.step, self.publish)
            return
        self.store(body)
        if not self.touched:
            return
        if not self.step:
            self.publish()
        elif self.flush_at is None:
            self.flush_at = asyncio.get_running_loop().call_later(self.step, self.publish)

    def store(self, body: bytes) -> None:
        lru = self.lru
        touched = self.touched
        for hashes in self.hasher.prompts(body):
            for h in hashes:
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
                    touched.add(h)
        while len(lru) > self.capacity:
            touched.add(lru.popitem(last=False)[0])

    def publish(self) -> None:
        """The net change since the last publish: a block stored and evicted meanwhile goes out as removed."""
        self.flush_at = None
        queued, self.queued = self.queued, []
        for body in queued:
            self.store(body)
        if not self.touched:
            return
        lru = self.lru
        stored = [h for h in self.touched if h in lru]
        removed = [h for h in self.touched if h not in lru]
        self.touched = set()
        self.index.publish(stored, removed)


CACHE: PrefixCache | None = None


class Stub(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        method = self.parser.get_method().decode()
        path = self.url.decode().split("?", 1)[0]
        out = CANNED.get((method, path, keep))
        self.transport.write(out if out is not None else answer(404, b'{"error": "not found"}', keep))
        if not keep:
            self.transport.close()
        if CACHE is not None and self.body and method == "POST":
            CACHE.served(b"".join(self.body))


def heartbeat(args) -> None:
    from pdpool.kv_index import HeartbeatThread, NodeIndex, NodeInfo, PoolKeys, connect, new_incarnation

    global CACHE
    inc = new_incarnation()
    index = NodeIndex(connect(args.redis), PoolKeys("default", args.pool), args.node_id, inc, heartbeat_ttl=3.0)
    index.resync([])   # a new incarnation starts with an empty cache, as a node does
    if args.kv_blocks:
        CACHE = PrefixCache(index, args.kv_blocks, args.step_ms / 1000, args.index_work == "step")
    info = NodeInfo(args.node_id, "both", f"http://127.0.0.1:{args.port}", inc,
                    fingerprint={"model_id": "demo", "dtype": "float32", "block_size": 16})
    HeartbeatThread(index, lambda: info, 1.0).start()


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Stub, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--redis")
    p.add_argument("--node-id")
    p.add_argument("--pool", default="bench")
    p.add_argument("--kv-blocks", type=int, default=4096,
                   help="blocks of the prefix cache published to Redis (0: publish nothing, heartbeats only)")
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="publish the cache's changes at most once per this many ms, as an engine does once per "
                        "step (0: every request's on its own)")
    p.add_argument("--index-work", choices=("step", "response"), default="step",
                   help="when a served prompt's blocks are hashed and stored: at the next publish step, as an engine "
                        "stores a step's blocks after the step (default), or right after the answer is written "
                        "(before round 9 of the overhead work)")
    args = p.parse_args()
    if args.redis:
        heartbeat(args)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.port))
    else:
        uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
