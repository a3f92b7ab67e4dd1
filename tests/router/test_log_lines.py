"""The router's buffered log lines (router/log_lines.py): the same text as the logging module writes, in order,
nothing lost (a warning at once, the rest within the flush interval and at exit, across a fork)."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from pdpool import logs
from pdpool.router import log_lines
from pdpool.router.main import _lean_log_records


@contextlib.contextmanager
def _router_logging():
    """The router's setup (``main``'s three calls) with the handler's stream swapped for a StringIO."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.configure()
    _lean_log_records()
    log_lines.buffer_root_handlers()
    handler = root.handlers[0]
    handler.stream = io.StringIO()
    try:
        yield handler
    finally:
        handler.close()
        root.handlers[:], root.level = saved
        log_lines._fast = None


@pytest.fixture
def router_logging():
    with _router_logging() as handler:
        yield handler


def test_the_router_setup_takes_the_fast_path(router_logging):
    assert isinstance(router_logging, log_lines.BufferedLineHandler)
    assert log_lines._fast is router_logging


@settings(max_examples=60, deadline=None)
@given(node=st.text(min_size=1, max_size=20), matched=st.dictionaries(st.text(max_size=8), st.integers(0, 10**6)),
       rid=st.from_regex(r"[A-Za-z0-9._:@/+=-]{1,40}", fullmatch=True),
       created=st.floats(1.6e9, 2.0e9, allow_nan=False))
def test_fast_line_is_the_formatters_line(node, matched, rid, created):
    logger = logging.getLogger("pdpool.router")
    real_time = time.time
    written = []
    with _router_logging() as handler:
        token = logs.request_id_var.set(rid)

        def text_of(write) -> None:
            write()
            handler.flush()
            written.append(handler.stream.getvalue())
            handler.stream.seek(0)
            handler.stream.truncate()

        try:
            time.time = lambda: created      # logging's LogRecord and log_lines both read time.time()
            text_of(lambda: logger.info("route: decode-only %s (matched blocks %s)", node, matched))
            text_of(lambda: log_lines.info(logger, "route: decode-only %s (matched blocks %s)", node, matched))
            text_of(lambda: logger.info("no arguments: 100% plain"))
            text_of(lambda: log_lines.info(logger, "no arguments: 100% plain"))
        finally:
            time.time = real_time
            logs.request_id_var.reset(token)
    assert written[0] == written[1] and written[2] == written[3], written
    assert written[0].endswith("\n") and written[2].endswith(" no arguments: 100% plain\n")


def test_other_setups_go_through_logging(router_logging, caplog):
    """A capturing handler (pytest's caplog), a handler on the way up, or a level above INFO: logger.info itself."""
    logger = logging.getLogger("pdpool.router")
    with caplog.at_level(logging.INFO):
        log_lines.info(logger, "seen by %s", "caplog")
    assert [r.getMessage() for r in caplog.records] == ["seen by caplog"]
    extra = logging.StreamHandler(io.StringIO())
    logging.getLogger("pdpool").addHandler(extra)
    try:
        log_lines.info(logger, "seen by %s", "the pdpool logger's handler")
    finally:
        logging.getLogger("pdpool").removeHandler(extra)
    assert "the pdpool logger's handler" in extra.stream.getvalue()
    logger.setLevel(logging.WARNING)
    try:
        log_lines.info(logger, "not written")
    finally:
        logger.setLevel(logging.NOTSET)
    router_logging.flush()
    assert "not written" not in router_logging.stream.getvalue()


def test_lines_keep_their_order_and_a_warning_writes_at_once(router_logging):
    logger = logging.getLogger("pdpool.router")
    log_lines.info(logger, "first")
    logger.info("second")
    assert router_logging.stream.getvalue() == ""          # buffered
    logger.warning("third")
    text = router_logging.stream.getvalue()
    assert [line.rsplit(" ", 1)[1] for line in text.splitlines()] == ["first", "second", "third"]


def test_the_writer_thread_flushes_within_the_interval(router_logging):
    log_lines.info(logging.getLogger("pdpool.router"), "soon")
    deadline = time.monotonic() + 5
    while "soon" not in router_logging.stream.getvalue():
        assert time.monotonic() < deadline, "never written"
        time.sleep(0.01)


SCRIPT = r"""
import logging, os, sys
from pdpool import logs
from pdpool.router import log_lines
from pdpool.router.main import _lean_log_records
logs.configure(); _lean_log_records(); log_lines.buffer_root_handlers()
logger = logging.getLogger("pdpool.router")
log_lines.info(logger, "parent before fork")
pid = os.fork()
if pid == 0:
    log_lines.info(logger, "child %d", 1)
    log_lines.flush_all()          # what router/workers.py does before os._exit
    os._exit(0)
os.waitpid(pid, 0)
log_lines.info(logger, "parent at exit")
"""


def test_nothing_is_lost_at_exit_or_across_a_fork():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    lines = [line.split("] ", 1)[1] for line in r.stderr.splitlines()]
    assert lines == ["parent before fork", "child 1", "parent at exit"], r.stderr
