"""``pdpool router --workers N``: N router processes accepting on one port, under a small supervisor.

    supervisor (this process: no event loop, no sockets)
      -- fork --> worker 0: its own event loop, Router, socket bound with SO_REUSEPORT on host:port
      -- fork --> worker 1: ...                      (the kernel spreads new connections over the sockets)

Each worker is a whole router. What they share lives outside them: the precise prefix index and the nodes'
heartbeats in Redis (as two active-active routers share them), and the Prometheus counters in
``PROMETHEUS_MULTIPROC_DIR`` (``router/metrics.py``), so any worker's ``/metrics`` answers with the totals.
What each keeps to itself: its count of requests in flight per node, its "just routed" window and its
approximate index; each balances its own share of the traffic.

SIGTERM or SIGINT to the supervisor goes to every worker; each finishes what it serves and exits, then the
supervisor does. A worker that dies otherwise is restarted, after a backoff that grows while it keeps dying
young. A worker stops with its supervisor even when the supervisor is SIGKILLed: the kernel sends it
``PARENT_DEATH`` (``PR_SET_PDEATHSIG``), and it drains and exits as on SIGTERM, then cleans up what the
supervisor would have (``supervisor_gone``).

The kernel sends that signal each time the worker is handed to a new parent: first when the supervisor's thread
that forked it exits, while ``getppid()`` still names the supervisor if any other of its threads (a log writer, a
tokenizer pool) is still exiting, then again when the last one has. So the signal is SIGHUP, not the supervisor's
own SIGTERM, to tell "the supervisor is gone" apart from "the supervisor says stop"; and its handler stays
installed for the worker's whole life, so the second delivery cannot kill a worker that is still draining or
cleaning up (it did, with SIGTERM's default action once the event loop had closed).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Callable

from pdpool.router import log_lines
from pdpool.utils import bind_sockets

logger = logging.getLogger("pdpool.router")

_SIGNALS = {signal.SIGTERM, signal.SIGINT}
PARENT_DEATH = signal.SIGHUP    # what a worker gets when its supervisor dies (above)
YOUNG_SECONDS = 10.0        # a worker that dies younger than this counts as failing: its restart waits longer
MAX_BACKOFF_SECONDS = 30.0


def check_port_free(host: str | None, port: int) -> list[str]:
    """The addresses every worker must bind (``host`` unset: IPv4 and IPv6, or what of them this machine has);
    raise ``OSError`` when host:port is taken. Workers bind with SO_REUSEPORT, which would silently share a port
    with another process that did the same (another router started on that port): bind without it first. Each
    worker then binds exactly these addresses, so all of them listen on the same set."""
    sockets = bind_sockets(host, port)
    addresses = [sock.getsockname()[0] for sock in sockets]
    for sock in sockets:
        sock.close()
    return addresses


class _Orphan:
    """This worker's view of its supervisor's death: whether ``PARENT_DEATH`` came, and what to call then."""

    orphaned = False
    on_death: Callable[[], None] | None = None


def supervisor_gone(supervisor: int, wait_seconds: float = 2.0) -> bool:
    """True in a worker whose supervisor died, so never cleans up after its workers. After ``PARENT_DEATH`` the
    supervisor may still be exiting (above): wait for that, up to ``wait_seconds`` (a stray SIGHUP sent to a
    worker, with the supervisor alive, stops that worker but leaves the supervisor's files alone)."""
    if os.getppid() != supervisor:
        return True
    if not _Orphan.orphaned:
        return False
    deadline = time.monotonic() + wait_seconds
    while os.getppid() == supervisor:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def on_parent_death(callback: Callable[[], None]) -> None:
    """Call ``callback`` (from the signal handler, in the main thread) once the supervisor dies; at once when it
    has already died."""
    _Orphan.on_death = callback
    if _Orphan.orphaned:
        callback()


def _parent_died(signum, frame) -> None:
    if _Orphan.orphaned:      # sent again as the supervisor's last thread exits: already stopping
        return
    _Orphan.orphaned = True
    if _Orphan.on_death is not None:
        _Orphan.on_death()


def _die_with_parent(parent: int) -> None:
    signal.signal(PARENT_DEATH, _parent_died)   # before prctl: the signal must never find its default action
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, PARENT_DEATH)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the supervisor's SIGTERM still reaches the workers
        pass
    if os.getppid() != parent:          # the supervisor died before prctl took effect
        os._exit(1)


def _fork(index: int, run_worker: Callable[[int], int]) -> int:
    parent = os.getpid()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)   # no supervisor handler may run in the child
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return pid
    code = 1
    try:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        _die_with_parent(parent)
        code = run_worker(index) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report, then exit the child whatever happened
        logger.exception("router worker %d failed", index)
    finally:
        log_lines.flush_all()      # buffered log lines (router/log_lines.py): os._exit skips logging.shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def supervise(num_workers: int, run_worker: Callable[[int], int], on_exit: Callable[[int], None] = lambda pid: None,
              poll_seconds: float = 0.1) -> int:
    """Run ``run_worker(index)`` in ``num_workers`` forked processes until SIGTERM/SIGINT; ``on_exit(pid)`` after
    each worker ends. Returns 0 once every worker has stopped after a signal."""
    stopping = False
    workers: dict[int, tuple[int, float]] = {}          # pid -> (index, start time)
    due = {i: 0.0 for i in range(num_workers)}          # index -> when to (re)start it
    failures = [0] * num_workers

    signalled: set[int] = set()

    def on_signal(signum, frame) -> None:   # the loop below passes SIGTERM on (also to a worker forked meanwhile)
        nonlocal stopping
        if not stopping:
            logger.info("router supervisor: %s, stopping %d workers", signal.Signals(signum).name, len(workers))
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in _SIGNALS}
    try:
        while True:
            now = time.monotonic()
            if not stopping:
                for index, when in list(due.items()):
                    if now >= when:
                        del due[index]
                        pid = _fork(index, run_worker)
                        workers[pid] = (index, time.monotonic())
                        logger.info("router worker %d started (pid %d)", index, pid)
            elif not workers:
                return 0
            else:
                for pid in set(workers) - signalled:
                    signalled.add(pid)
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if not pid:
                time.sleep(poll_seconds)
                continue
            if pid not in workers:
                continue
            index, started = workers.pop(pid)
            on_exit(pid)
            if stopping:
                continue
            young = time.monotonic() - started < YOUNG_SECONDS
            failures[index] = failures[index] + 1 if young else 0
            delay = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** failures[index]) if young else 0.0
            logger.warning("router worker %d (pid %d) exited with %d; restarting it in %.1f s", index, pid,
                           os.waitstatus_to_exitcode(status), delay)
            due[index] = time.monotonic() + delay
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
