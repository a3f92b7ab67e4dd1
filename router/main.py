"""``pdpool router``: parse the flags (and ``--config`` YAML), build the router, serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from pdpool import logs as log
from pdpool.router import settings
from pdpool.utils import wait_for_stop_signal

logger = logging.getLogger("pdpool.router")

# Token ids of recent prompt chunks (about 256 characters each; pdpool.frontend.TokenChunkCache): shared system
# prompts and documents are tokenized once. 8192 chunks hold about 2M characters, a few tens of MB.
TOKEN_CACHE_CHUNKS = 8192


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, scheduler = settings.load(argv)
        profile = settings.profile(cfg, scheduler)
    except settings.SettingsError as exc:
        print(f"pdpool router: error: {exc}", file=sys.stderr)
        return 2
    r = cfg.router
    if not (r.prefill or r.decode or r.both or r.redis or r.kubernetes):
        print("pdpool router: error: no discovery source: give --redis (with --pool), static node URLs "
              "(--prefill/--decode/--both) or --kubernetes", file=sys.stderr)
        return 2
    if r.kubernetes:
        from pdpool.router.discovery_k8s import KubeConfigError, connect

        try:
            connect(r.kube_api)
        except KubeConfigError as exc:
            print(f"pdpool router: error: --kubernetes: {exc}", file=sys.stderr)
            return 2
    log.configure()
    from pdpool.frontend import Frontend  # tokenizers + jinja2; never torch
    from pdpool.router.app import Router, create_app

    try:
        frontend = Frontend.from_model(r.model, token_cache_chunks=TOKEN_CACHE_CHUNKS)
    except (OSError, ValueError) as exc:
        print(f"pdpool router: error: cannot read the tokenizer of --model {r.model}: {exc}", file=sys.stderr)
        return 2
    # uvloop was tried: no measurable win on the router's latency or CPU (docs/performance.md), so plain asyncio.
    asyncio.run(_serve(create_app(Router(cfg, profile, frontend)), r.host, r.port))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    logger.info("pdpool router listening on http://%s:%d", host, port)
    try:
        await wait_for_stop_signal()
    finally:
        logger.info("router shutting down")
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
