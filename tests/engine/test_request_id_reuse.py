"""``AsyncLLM``: an id whose request ended (aborted by its consumer, or cut at a stop string while the engine still
ran it) may be used again at once, and the new request gets exactly its own outputs: none of the old request's,
which a step already queued on the engine thread still computes, and its stream is not dropped when the old stream's
generator is finalized late (a consumer that broke out of ``async for`` without closing it). Real engine (demo
model, float32)."""

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
    engine = llm.engine
    free_before = engine.kv_cache_manager.num_free_blocks

    async def main():
        allm = AsyncLLM(llm.config, engine=engine, frontend=llm.frontend)
        try:
            expected = await tokens(await allm.add_request("fresh", NEW_PROMPT, PARAMS))
            got = await asyncio.wait_for(body(allm), 30)
        finally:
            await allm.shutdown()
        return expected, got

    expected, got = asyncio.run(main())
    assert got == expected
    assert engine.kv_cache_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("num_read", [1, 3])
def test_an_id_reused_right_after_its_abort_gets_only_its_own_tokens(llm, num_read):
    async def body(allm):
        it = (await allm.add_request("x", OLD_PROMPT, PARAMS)).__aiter__()
        for _ in range(num_read):
            await it.__anext__()
        await it.aclose()   # aborts "x"; the step already queued still computes its next token
        return await tokens(await allm.add_request("x", NEW_PROMPT, PARAMS))

    run_with(llm, body)


def test_an_id_reused_right_after_a_stop_string_gets_only_its_own_tokens(llm):
    old = llm.generate([OLD_PROMPT], PARAMS, use_tqdm=False)[0]
    stop = old.text[len(llm.tokenizer.decode(old.output_token_ids[:2])):][:3]
    assert stop.strip()

    async def body(allm):
        outs = [o async for o in await allm.add_request("x", OLD_PROMPT, SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop]))]
        assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens < 8
        return await tokens(await allm.add_request("x", NEW_PROMPT, PARAMS))

    run_with(llm, body)


def test_the_old_streams_late_finalization_leaves_the_new_stream(llm):
    async def body(allm):
        old = (await allm.add_request("x", OLD_PROMPT, PARAMS)).__aiter__()
        while not (await old.__anext__()).finished:   # as `async for ...: if out.finished: break` leaves it open
            pass
        stream = await allm.add_request("x", NEW_PROMPT, PARAMS)
        await old.aclose()   # what the collector does to the old generator, some time later
        return await tokens(stream)

    run_with(llm, body)


def test_an_add_cancelled_while_the_old_request_of_its_id_is_aborted_leaves_that_abort(llm):
    engine = llm.engine

    async def main():
        allm = AsyncLLM(llm.config, engine=engine, frontend=llm.frontend)
        try:
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
            return await allm.call(engine.has_unfinished_requests)
        finally:
            await allm.shutdown()

    assert asyncio.run(main()) is False
