"""``router/eager.py``: a coroutine's first step runs inside ``start_eagerly``, with its task current and in its
task's context; the task then goes on from the first wait with the usual results, exceptions and cancellation,
on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from pdpool.router.eager import start_eagerly

var = contextvars.ContextVar("var", default="unset")


def loops():
    yield asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        return
    yield uvloop.new_event_loop


@pytest.fixture(params=list(loops()), ids=lambda f: f.__module__.split(".")[0])
def loop(request):
    lp = request.param()
    yield lp
    lp.close()


def in_callback(loop, fn):
    """``fn()`` from a loop callback (no task running), as the server's protocol calls ``start_eagerly``."""
    async def main():
        done = loop.create_future()
        loop.call_soon(lambda: done.set_result(fn()))
        return await done
    return loop.run_until_complete(main())


def test_the_first_step_runs_now_with_its_task_current_and_the_rest_in_the_same_context(loop):
    steps = []

    async def handler():
        task = asyncio.current_task()
        steps.append(("first", task))
        var.set("request-7")
        await asyncio.sleep(0)
        steps.append(("rest", asyncio.current_task() is task, var.get()))
        return 42

    def start():
        task = start_eagerly(loop, handler())
        assert steps == [("first", task)]          # ran before start_eagerly returned, inside its own task
        return task

    task = in_callback(loop, start)
    assert var.get() == "unset"                     # the request's context is its own
    assert loop.run_until_complete(task) == 42
    assert steps[1] == ("rest", True, "request-7")


def test_a_coroutine_that_ends_in_its_first_step_gives_its_result_or_its_exception(loop):
    async def returns():
        return "done"

    async def raises():
        raise ValueError("bad")

    assert loop.run_until_complete(in_callback(loop, lambda: start_eagerly(loop, returns()))) == "done"
    with pytest.raises(ValueError, match="bad"):
        loop.run_until_complete(in_callback(loop, lambda: start_eagerly(loop, raises())))


def test_cancelled_before_its_task_ran_it_reaches_the_coroutine_where_it_waits(loop):
    cleaned = []

    async def handler():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    def start():
        task = start_eagerly(loop, handler())
        task.cancel()                  # the task's own first step has not run yet
        return task

    task = in_callback(loop, start)
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(task)
    assert cleaned == [True]


def test_cancelled_while_waiting_later(loop):
    cleaned = []

    async def handler():
        await asyncio.sleep(0)
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    task = in_callback(loop, lambda: start_eagerly(loop, handler()))

    async def cancel_soon():
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    loop.run_until_complete(cancel_soon())
    assert cleaned == [True]
