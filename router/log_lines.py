"""The router's log lines, written in batches, and the per-request line without a ``LogRecord``: the router logs
a line per request.

``BufferedLineHandler`` formats each record at once (the same text, the same order as the stream handler it
replaces) and keeps the line; a background thread writes what has gathered ``FLUSH_SECONDS`` after the first line
of a batch, in one ``write``. A WARNING or worse writes everything gathered, itself included, at once. Nothing is
lost on the way out: ``flush()`` runs at interpreter exit (``logging.shutdown``), before a fork (the child starts
its own writer thread), and in ``router/workers.py`` before a worker's ``os._exit``. A process killed with SIGKILL
loses at most the last ``FLUSH_SECONDS`` of lines.

``info(logger, msg, *args)`` is ``logger.info(msg, *args)`` for the request path's own lines. Where the logging
setup is the router's (the root's one handler buffered, with ``pdpool.logs``' format and its request-id filter,
and no handler or filter anywhere else on the way), it writes the very line the formatter would (date and time
to the millisecond, level, logger name, request id, message) straight into the buffer: the ``LogRecord``, the
filter and the formatter's passes cost about 6% of the router's CPU per request (docs/performance.md, router
overhead round 7). Any other setup (a test's capturing handler, another format, the level above INFO) takes
``logger.info`` itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pdpool import logs

FLUSH_SECONDS = 0.05
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"   # pdpool.logs.configure's
_fast: "BufferedLineHandler | None" = None     # the root's handler, when its setup is the one info() writes for
_second = [-1, ""]                               # the last second's date and time text


class BufferedLineHandler(logging.StreamHandler):
    def __init__(self, stream=None, flush_seconds: float = FLUSH_SECONDS) -> None:
        super().__init__(stream)
        self.flush_seconds = flush_seconds
        self._lines: list[str] = []
        self._pending = threading.Event()
        self._closed = False
        self._start_writer()
        os.register_at_fork(before=self.flush, after_in_child=self._after_fork)

    def _start_writer(self) -> None:
        threading.Thread(target=self._write_batches, name="router-log-writer", daemon=True).start()

    def _after_fork(self) -> None:
        self._lines = []
        self._pending = threading.Event()
        if not self._closed:
            self._start_writer()

    def emit(self, record: logging.LogRecord) -> None:
        """Runs under the handler's lock (``Handler.handle``)."""
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)
            return
        lines = self._lines
        lines.append(line)
        if record.levelno >= logging.WARNING or self._closed:
            self.flush()
        elif len(lines) == 1:
            self._pending.set()

    def add_line(self, line: str) -> None:
        with self.lock:
            lines = self._lines
            lines.append(line)
            if len(lines) == 1:
                self._pending.set()

    def flush(self) -> None:
        with self.lock:
            lines, self._lines = self._lines, []
            if lines and self.stream is not None:
                try:
                    self.stream.write("".join(lines))
                    self.stream.flush()
                except Exception:  # noqa: BLE001 - a closed or broken stream must not take the router down
                    pass

    def close(self) -> None:
        self.flush()
        self._closed = True
        self._pending.set()
        super().close()

    def _write_batches(self) -> None:
        pending = self._pending
        while not self._closed:
            pending.wait()
            pending.clear()
            time.sleep(self.flush_seconds)
            self.flush()


def buffer_root_handlers() -> None:
    """Replace the root logger's plain stream handlers (``pdpool.logs.configure``'s) by buffered ones with the same
    stream, filters and formatter."""
    global _fast
    root = logging.getLogger()
    for i, h in enumerate(root.handlers):
        if type(h) is logging.StreamHandler:
            b = BufferedLineHandler(h.stream)
            b.setLevel(h.level)
            b.setFormatter(h.formatter)
            for f in h.filters:
                b.addFilter(f)
            root.handlers[i] = b
    _fast = None
    if len(root.handlers) == 1 and isinstance(root.handlers[0], BufferedLineHandler):
        h = root.handlers[0]
        f = h.formatter
        if (f is not None and f._fmt == _FORMAT and f.datefmt is None and f.converter is time.localtime
                and f.default_time_format == "%Y-%m-%d %H:%M:%S" and f.default_msec_format == "%s,%03d"
                and type(f).format is logging.Formatter.format and h.level <= logging.INFO
                and len(h.filters) == 1 and type(h.filters[0]) is logs.RequestIdFilter):
            _fast = h


def info(logger: logging.Logger, msg: str, *args) -> None:
    """``logger.info(msg, *args)``; see the module's docstring."""
    fast = _fast
    if fast is None or not logger.isEnabledFor(logging.INFO) or logger.filters or not _plain_path(logger, fast):
        logger.info(msg, *args)
        return
    created = time.time()
    second = int(created)
    if second != _second[0]:
        _second[0], _second[1] = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    msecs = int((created - second) * 1000)
    fast.add_line(f"{_second[1]},{msecs:03d} INFO {logger.name} [{logs.request_id_var.get()}] "
                  f"{msg % args if args else msg}\n")


def _plain_path(logger: logging.Logger, fast: BufferedLineHandler) -> bool:
    """The record would reach ``fast`` and nothing else: no handler on the way up, the root's only handler."""
    c = logger
    while c.parent is not None:
        if c.handlers or not c.propagate:
            return False
        c = c.parent
    hs = c.handlers
    return len(hs) == 1 and hs[0] is fast


def flush_all() -> None:
    for h in logging.getLogger().handlers:
        h.flush()
