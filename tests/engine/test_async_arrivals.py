"""``AsyncLLM`` from idle: requests that arrive a few ms apart (a burst, as a client sends a new wave when the last
one ends) share their first step, instead of the first one being prefilled alone while the others wait out its
prefill; every one of them still finishes and frees its KV blocks. Real engine (demo model, float32)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine import async_llm
from pdpool.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=8, max_model_len=256, num_kv_blocks=64)


def test_a_burst_from_idle_is_prefilled_in_one_step(llm, monkeypatch):
    # Wider windows than the defaults, so that a loaded test machine's scheduling delays stay inside them; the
    # arrivals below are 5 ms apart (the defaults: 4 ms quiet, 30 ms at most).
    monkeypatch.setattr(llm.config.scheduler, "arrival_wait_ms", 100.0)
    monkeypatch.setattr(async_llm, "ARRIVAL_MAX_WAIT_SECONDS", 2.0)
    engine = llm.engine
    scheduled: list[int] = []
    step = engine.step

    def recording_step():
        outputs = step()
        scheduled.append(engine.last_step_num_scheduled)
        return outputs

    monkeypatch.setattr(engine, "step", recording_step)
    free_before = engine.kv_cache_manager.num_free_blocks

    async def run() -> list[list[int]]:
        allm = AsyncLLM(llm.config, engine=engine, frontend=llm.frontend)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        streams = []
        for i in range(4):
            streams.append(await allm.add_request(f"burst-{i}", [1000 + i] * 20, params))
            await asyncio.sleep(0.005)

        async def collect(stream):
            return [t for out in [o async for o in stream] for t in out.new_token_ids]

        tokens = await asyncio.gather(*(collect(s) for s in streams))
        await allm.shutdown()
        return tokens

    tokens = asyncio.run(run())
    assert scheduled[0] == 4, scheduled  # all four in the first step
    assert all(len(t) == 3 for t in tokens)
    assert engine.kv_cache_manager.num_free_blocks == free_before


def test_the_wait_is_on_cpu_by_default_off_on_cuda_and_set_by_the_flag(llm):
    def quiet(device: str, wait_ms: float | None) -> float:
        cfg = dataclasses.replace(llm.config, device=dataclasses.replace(llm.config.device, device=device),
                                  scheduler=dataclasses.replace(llm.config.scheduler, arrival_wait_ms=wait_ms))
        return AsyncLLM(cfg, engine=llm.engine, frontend=llm.frontend)._arrival_quiet

    assert quiet("cpu", None) == async_llm.ARRIVAL_QUIET_MS_CPU / 1000
    assert quiet("cuda", None) == 0.0  # a lone request's TTFT on a GPU is a few ms: no wait unless asked for
    assert quiet("cpu", 0.0) == 0.0
    assert quiet("cuda", 2.5) == 0.0025
