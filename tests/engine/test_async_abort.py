"""``AsyncLLM.abort(request_id)`` from another task ends the request's stream as vLLM's ``AsyncLLM.abort`` ends
``generate()``: its consumer gets a final output with ``finish_reason`` "abort" (the totals so far), instead of
waiting for ever, and the request's KV blocks go back to the pool. Real engine (demo model, float32)."""

from __future__ import annotations

import asyncio

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine.async_llm import AsyncLLM

PROMPT = [3000 + i for i in range(10)]


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=4, max_model_len=128, num_kv_blocks=32,
               block_size=8)


@pytest.mark.parametrize("num_read", [0, 2])
def test_abort_from_another_task_ends_the_stream_with_an_abort_output(llm, num_read):
    engine = llm.engine
    free_before = engine.kv_cache_manager.num_free_blocks

    async def main():
        allm = AsyncLLM(llm.config, engine=engine, frontend=llm.frontend)
        try:
            stream = await allm.add_request("x", PROMPT, SamplingParams(max_tokens=100, temperature=0.0,
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
            await allm.call(lambda: None)   # the engine's abort has run
            return outs
        finally:
            await allm.shutdown()

    outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and final.finish_reason == "abort"
    streamed = [t for out in outs for t in out.new_token_ids]
    assert final.output_token_ids == streamed and final.num_output_tokens == len(streamed) < 100
    assert len(streamed) >= num_read
    assert engine.kv_cache_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()


def test_shutdown_ends_the_loop_when_a_wake_comes_with_it(llm):
    """The loop's cancel can be lost when its wait for work ends in the same turn (asyncio.wait_for before Python
    3.12 then returns the result); shutdown still ends the loop instead of waiting for it for ever."""
    async def main():
        allm = AsyncLLM(llm.config, engine=llm.engine, frontend=llm.frontend)
        [_ async for _ in await allm.add_request("w", PROMPT, SamplingParams(max_tokens=2))]
        await asyncio.sleep(0.05)   # idle after work: the loop waits for work with a timeout (the heap trim)
        allm.wake()
        shutdown = asyncio.ensure_future(allm.shutdown())
        done, _ = await asyncio.wait({shutdown}, timeout=10)
        assert done, "shutdown waits for the engine loop"
        await shutdown

    asyncio.run(main())
