"""A fast stub OpenAI upstream for the router overhead benchmark: answers at once, optionally heartbeats into
Redis as a pdpool node (role both) so the router's Redis discovery and precise prefix lookup run as in a pool.

    python benchmarks/router_stub_upstream.py --port 9001 [--redis redis://127.0.0.1:6379/0 --node-id stub-1]

A raw asyncio protocol on httptools (llhttp), on uvloop when installed: every answer is a canned one, written from
the parser's callback, so the stub costs the shared 2-core machine as little CPU as it can (it was aiohttp before
round 4 of the overhead work; the same stub serves every router measured and the direct baseline). Keep-alive
and pipelined requests are answered in order; bodies of any framing are read and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json

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


class Stub(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
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


def heartbeat(args) -> None:
    from pdpool.kv_index import HeartbeatThread, NodeIndex, NodeInfo, PoolKeys, connect, new_incarnation

    inc = new_incarnation()
    index = NodeIndex(connect(args.redis), PoolKeys("default", "bench"), args.node_id, inc, heartbeat_ttl=3.0)
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
