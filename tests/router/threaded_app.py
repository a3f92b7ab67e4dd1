"""An aiohttp app served on its own thread and event loop: a stand-in upstream (an OpenAI server of another make,
a server with a given behaviour) for the router's tests, which call it from the test's thread."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ThreadedApp:
    def __init__(self, app: web.Application, **runner_kw) -> None:
        """``runner_kw``: ``web.AppRunner``'s (``keepalive_timeout``, ``handler_cancellation``, ...)."""
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(app, runner_kw, ready), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, app: web.Application, runner_kw: dict, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(app, **runner_kw)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
