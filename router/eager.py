"""Eager tasks: a coroutine runs its first step at once, inside its task, instead of a loop iteration later.

    start_eagerly(loop, coro) -> Task
        the coroutine runs now, up to its first real wait (for the router: parse, tokenize, plan, and the
        upstream request written); the task then goes on from that wait as any task does

The router's server (``router/server.py``) starts each request's task this way on Python 3.12+, where it is
asyncio's own ``eager_start`` (in C). ``_Resumed`` does the same on 3.11, with the task current
(``asyncio.current_task()``; aiohttp's timeouts need it) and in the task's context, so what the first step sets in a
context variable (the request id) holds for the rest. It is correct (tests/router/test_eager.py, and the server's
tests run with it), but under uvloop it costs more than the loop iteration it saves, so the server does not use it on
3.11 (docs/performance.md, router overhead round 12).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine) -> asyncio.Task:
    """A task for ``coro``, its first step run before this returns. Only from a callback (no task running)."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    context = contextvars.copy_context()
    resumed = _Resumed(coro)
    task = loop.create_task(resumed, context=context)    # its first step takes what the eager one left
    asyncio.tasks._enter_task(loop, task)
    try:
        context.run(resumed.first_step)
    finally:
        asyncio.tasks._leave_task(loop, task)
    return task


class _Resumed(Coroutine):
    """``coro`` for a task, after ``first_step`` ran it up to its first wait: the task's first ``send`` gets what
    that step yielded (the future it waits on), returned or raised; every later ``send``/``throw`` goes to
    ``coro`` as is. A task cancelled before its first step throws into ``coro`` where it waits."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine) -> None:
        self._coro = coro
        self._first: tuple | None = None

    def first_step(self) -> None:
        try:
            self._first = ("yield", self._coro.send(None))
        except StopIteration as stop:
            self._first = ("return", stop.value)
        except BaseException as exc:  # noqa: BLE001 - the task raises it, as it would have
            self._first = ("raise", exc)

    def send(self, value):
        first = self._first
        if first is None:
            return self._coro.send(value)
        self._first = None
        kind, result = first
        if kind == "yield":
            return result
        if kind == "return":
            raise StopIteration(result)
        raise result

    def throw(self, *exc):
        self._first = None
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._first = None
        self._coro.close()

    def __await__(self):
        raise TypeError("an eagerly started coroutine is driven by its task only")
