"""``AsyncLLM`` under churn, on the real engine (demo model, float32).

- An id whose request ended (aborted by its consumer, or cut at a stop string while the engine still ran it) may
  be used again at once, and the new request gets exactly its own outputs: none of the old request's, which a step
  already queued on the engine thread still computes; its stream is not dropped when the old stream's generator is
  finalized late (a consumer that broke out of ``async for`` without closing it).
- ``AsyncLLM.abort(request_id)`` from another task ends the request's stream as vLLM's ``AsyncLLM.abort`` ends
  ``generate()``: its consumer gets a final output with ``finish_reason`` "abort" (the totals so far) instead of
  waiting for ever.
- ``shutdown`` ends the engine loop even when its cancel is lost.

Every test ends with every KV block free and no request left in the engine."""

from __future__ import annotations

import asyncio

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine.async_llm import AsyncLLM

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OLD_PROMPT = [4000 + i for i in range(10)]
NEW_PROMPT = [3000 + i for i in range(10)]


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=128, num_kv_blocks=32,
               block_size=8)


async def tokens(stream) -> list[int]:
    return [t for out in [o async for o in stream] for t in out.new_token_ids]


def run_with(llm, body):
    """``body(allm)`` on a new ``AsyncLLM`` over the module's engine, shut down after; its result. The engine is
    left with no request and every block free."""
    engine = llm.engine
    free_before = engine.kv_cache_manager.num_free_blocks

    async def main():
        allm = AsyncLLM(llm.config, engine=engine, frontend=llm.frontend)
        try:
            return await asyncio.wait_for(body(allm), 60)
        finally:
            await allm.shutdown()

    result = asyncio.run(main())
    assert engine.kv_cache_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()
    return result


def reused(llm, old_request_ends):
    """The tokens of NEW_PROMPT under a fresh id, and under the id "x" right after ``old_request_ends(allm)``."""
    async def body(allm):
        expected = await tokens(await allm.add_request("fresh", NEW_PROMPT, PARAMS))
        await old_request_ends(allm)
        return expected, await tokens(await allm.add_request("x", NEW_PROMPT, PARAMS))

    expected, got = run_with(llm, body)
    assert got == expected


@pytest.mark.parametrize("num_read", [1, 3])
def test_an_id_reused_right_after_its_abort_gets_only_its_own_tokens(llm, num_read):
    async def ends(allm):
        it = (await allm.add_request("x", OLD_PROMPT, PARAMS)).__aiter__()
        for _ in range(num_read):
            await it.__anext__()
        await it.aclose()   # aborts "x"; the step already queued still computes its next token

    reused(llm, ends)


def test_an_id_reused_right_after_a_stop_string_gets_only_its_own_tokens(llm):
    old = llm.generate([OLD_PROMPT], PARAMS, use_tqdm=False)[0]
    stop = old.text[len(llm.tokenizer.decode(old.output_token_ids[:2])):][:3]
    assert stop.strip()

    async def ends(allm):
        outs = [o async for o in await allm.add_request("x", OLD_PROMPT, SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop]))]
        assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens < 8

    reused(llm, ends)


def test_the_old_streams_late_finalization_leaves_the_new_stream(llm):
    async def body(allm):
        expected = await tokens(await allm.add_request("fresh", NEW_PROMPT, PARAMS))
        old = (await allm.add_request("x", OLD_PROMPT, PARAMS)).__aiter__()
        while not (await old.__anext__()).finished:   # as `async for ...: if out.finished: break` leaves it open
            pass
        stream = await allm.add_request("x", NEW_PROMPT, PARAMS)
        await old.aclose()   # what the collector does to the old generator, some time later
        return expected, await tokens(stream)

    expected, got = run_with(llm, body)
    assert got == expected


def test_an_add_cancelled_while_the_old_request_of_its_id_is_aborted_leaves_that_abort(llm):
    async def body(allm):
        it = (await allm.add_request("x", OLD_PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))).__aiter__()
        await it.__anext__()   # the next step is queued on the engine thread
        await it.aclose()      # the abort of "x" is queued behind it
        add = asyncio.ensure_future(allm.add_request("x", NEW_PROMPT, PARAMS))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not add.done()   # waiting for the abort
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
        return await allm.call(llm.engine.has_unfinished_requests)

    assert run_with(llm, body) is False   # before shutdown, which aborts every request


@pytest.mark.parametrize("num_read", [0, 2])
def test_abort_from_another_task_ends_the_stream_with_an_abort_output(llm, num_read):
    async def body(allm):
        stream = await allm.add_request("x", NEW_PROMPT, SamplingParams(max_tokens=100, temperature=0.0,
                                                                         ignore_eos=True))
        outs = []
        read = asyncio.Event()

        async def consume():
            async for out in stream:
                outs.append(out)
                if len(outs) >= num_read:
                    read.set()

        consumer = asyncio.ensure_future(consume())
        if num_read:
            await read.wait()
        await allm.abort("x")
        await asyncio.wait_for(consumer, 30)
        return outs

    outs = run_with(llm, body)
    final = outs[-1]
    assert final.finished and final.finish_reason == "abort"
    streamed = [t for out in outs for t in out.new_token_ids]
    assert final.output_token_ids == streamed and final.num_output_tokens == len(streamed) < 100
    assert len(streamed) >= num_read


def test_shutdown_ends_the_loop_when_a_wake_comes_with_it(llm):
    """The loop's cancel can be lost when its wait for work ends in the same turn (asyncio.wait_for before Python
    3.12 then returns the result); shutdown still ends the loop instead of waiting for it for ever."""
    async def main():
        allm = AsyncLLM(llm.config, engine=llm.engine, frontend=llm.frontend)
        await tokens(await allm.add_request("w", NEW_PROMPT, PARAMS))
        await asyncio.sleep(0.05)   # idle after work: the loop waits for work with a timeout (the heap trim)
        allm.wake()
        shutdown = asyncio.ensure_future(allm.shutdown())
        done, _ = await asyncio.wait({shutdown}, timeout=10)
        assert done, "shutdown waits for the engine loop"
        await shutdown

    asyncio.run(main())
