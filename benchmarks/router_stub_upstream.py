"""A fast stub OpenAI upstream for the router overhead benchmark: answers at once, optionally heartbeats into
Redis as a pdpool node (role both) so the router's Redis discovery and precise prefix lookup run as in a pool.

    python benchmarks/router_stub_upstream.py --port 9001 [--redis redis://127.0.0.1:6379/0 --node-id stub-1]
"""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

BODY = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "demo",
                   "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                   "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001,
                             "prompt_tokens_details": {"cached_tokens": 0}}}).encode()


async def completions(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=BODY, content_type="application/json")


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "demo", "object": "model", "owned_by": "stub"}]})


def heartbeat(args) -> None:
    from pdpool.kv_index import HeartbeatThread, NodeIndex, NodeInfo, PoolKeys, connect, new_incarnation

    inc = new_incarnation()
    index = NodeIndex(connect(args.redis), PoolKeys("default", "bench"), args.node_id, inc, heartbeat_ttl=3.0)
    info = NodeInfo(args.node_id, "both", f"http://127.0.0.1:{args.port}", inc,
                    fingerprint={"model_id": "demo", "dtype": "float32", "block_size": 16})
    HeartbeatThread(index, lambda: info, 1.0).start()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--redis")
    p.add_argument("--node-id")
    args = p.parse_args()
    if args.redis:
        heartbeat(args)
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    for path in ("/health", "/health/ready", "/health/live", "/health_generate", "/readiness", "/liveness"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", ok)
    app.router.add_get("/get_model_info", ok)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    time.sleep(0)
    main()
