"""``pdpool router``: parse the flags (and ``--config`` YAML), build the router, serve until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time

from pdpool import logs as log
from pdpool.router import log_lines, settings
from pdpool.utils import http_url, raise_open_files_limit, wait_for_stop_signal

logger = logging.getLogger("pdpool.router")

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
    raise_open_files_limit()          # before the workers fork: they inherit it
    _lean_log_records()
    log_lines.buffer_root_handlers()   # a line per request: written in batches (router/log_lines.py)
    if r.workers > 1:
        return _main_workers(cfg, profile)
    from pdpool.frontend import Frontend  # tokenizers + jinja2; never torch
    from pdpool.router.app import Router

    try:
        frontend = Frontend.from_model(r.model, r.token_cache_chunks, r.chat_template)
    except (OSError, ValueError) as exc:
        print(f"pdpool router: error: {_frontend_error(r, exc)}", file=sys.stderr)
        return 2
    run(_serve(Router(cfg, profile, frontend), r.host, r.port))
    return 0


def _frontend_error(r, exc: Exception) -> str:
    from pdpool.frontend import ChatTemplateError

    return str(exc) if isinstance(exc, ChatTemplateError) else f"cannot read the tokenizer of --model {r.model}: {exc}"


class _SecondCachedFormatter(logging.Formatter):
    """The same text as ``logging.Formatter``, with the date and time formatted once per second: the router logs a
    line per request. With the thread and process fields off too, one line took 12.7 instead of 22 µs
    (docs/performance.md, router overhead round 5)."""

    _second: int | None = None
    _text = ""

    def formatTime(self, record, datefmt=None):
        if datefmt is not None or self.datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return self.default_msec_format % (self._text, record.msecs)


def _lean_log_records() -> None:
    """Log records without the thread, process and caller fields (the format has none of them), formatted by
    ``_SecondCachedFormatter``; the lines stay the same (the logging docs' "Optimization" section)."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None   # no caller lookup (file, line, function: not in the format); the logging docs' knob
    for handler in logging.getLogger().handlers:
        f = handler.formatter
        if f is not None and type(f) is logging.Formatter and f.datefmt is None:
            handler.setFormatter(_SecondCachedFormatter(f._fmt))


def run(coro) -> None:
    """Run on uvloop when it is installed, else on asyncio's own loop. uvloop cut the CPU of the router's HTTP
    legs (server side and node client, measured apart) by about 0.06 ms per request (docs/performance.md)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _main_workers(cfg, profile) -> int:
    """``--workers N``: check what can fail at start once, here, then fork the workers (router/workers.py)."""
    import shutil
    import tempfile

    from pdpool.router import workers

    r = cfg.router
    try:
        addresses = workers.check_port_free(r.host, r.port)
    except OSError as exc:
        where = r.host or "every address"
        print(f"pdpool router: error: cannot listen on {where} port {r.port}: {exc}", file=sys.stderr)
        return 2
    # Before any import of prometheus_client, in this process and so in every worker (router/metrics.py).
    metrics_dir = tempfile.mkdtemp(prefix="pdpool-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import multiprocess

    from pdpool.frontend import Frontend
    from pdpool import native_text as native

    native.load()   # built (once) before the fork, not by every worker at once
    try:  # the tokenizer is read once here for a clear error; each worker reads its own after the fork
        Frontend.from_model(r.model, chat_template=r.chat_template)
    except (OSError, ValueError) as exc:
        print(f"pdpool router: error: {_frontend_error(r, exc)}", file=sys.stderr)
        return 2

    supervisor = os.getpid()

    def run_worker(index: int) -> int:
        from pdpool.router.app import Router

        frontend = Frontend.from_model(r.model, r.token_cache_chunks, r.chat_template)
        try:
            run(_serve(Router(cfg, profile, frontend), addresses, r.port, reuse_port=True, worker=index))
        finally:
            if workers.supervisor_gone(supervisor):  # its cleanup never ran: the last ones out
                shutil.rmtree(metrics_dir, ignore_errors=True)
        return 0

    logger.info("pdpool router: %d workers on %s", r.workers, ", ".join(http_url(a, r.port) for a in addresses))
    try:
        return workers.supervise(r.workers, run_worker, on_exit=lambda pid: multiprocess.mark_process_dead(
            pid, metrics_dir))
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _settle_gc() -> None:
    """The start-up heap (modules, tokenizer, config: about 58k of the 72k objects the router tracks once its caches
    are full) goes to the permanent generation, so the full collections (one took 15 ms) no longer walk it. A
    larger gen0 threshold as well (5000) measured no better than the default 700 (docs/performance.md, router
    overhead round 12)."""
    gc.freeze()


async def _serve(router, host: str | None | list[str], port: int, reuse_port: bool = False,
                 worker: int | None = None) -> None:
    from pdpool.router.server import start_server

    stop = asyncio.Event()
    if worker is not None:   # the supervisor's death stops a worker as its SIGTERM does (router/workers.py)
        from pdpool.router import workers

        loop = asyncio.get_running_loop()
        workers.on_parent_death(lambda: loop.call_soon_threadsafe(stop.set))
    await router.start()
    _settle_gc()
    try:
        server = await start_server(router.handle, host, port, reuse_port=reuse_port)
        name = "pdpool router" if worker is None else f"pdpool router worker {worker} (pid {os.getpid()})"
        logger.info("%s listening on %s", name, ", ".join(http_url(*sock.getsockname()[:2]) for sock in server.sockets))
        try:
            await wait_for_stop_signal(stop)
        finally:
            logger.info("router shutting down")
            server.close()    # no new connections; requests in flight finish (bounded below)
            await router.drain(timeout=10.0)
    finally:
        await router.stop()


if __name__ == "__main__":
    sys.exit(main())
