"""An idle node hands its freed C heap back to the OS: after steps have run and no request has come for
``HEAP_TRIM_IDLE_SECONDS``, the engine thread calls glibc's ``malloc_trim(0)`` once, between steps, never while
requests run, and not again until more work has run. Real engine (demo model, float32) and a real trim."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import pytest

from pdpool import LLM, SamplingParams
from pdpool.engine import async_llm
from pdpool.engine.async_llm import AsyncLLM
from pdpool.utils import release_free_heap


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_release_free_heap_gives_freed_heap_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks sit below glibc's mmap threshold: freed, they stay in the heap until a trim
    blocks = [libc.malloc(64 * 1024) for _ in range(3200)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)    # touch every page
    # keep the last block, so the heap's top cannot shrink on free alone
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_mib()
    assert release_free_heap()
    after = _rss_mib()
    libc.free(blocks[-1])
    assert before - after > 100, (before, after)   # ~200 MiB freed; glibc keeps it without a trim


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM("demo", dtype="float32", num_threads=1, max_num_seqs=8, max_model_len=256, num_kv_blocks=64)


def test_the_engine_trims_once_when_idle_after_work(llm, monkeypatch):
    monkeypatch.setattr(async_llm, "HEAP_TRIM_IDLE_SECONDS", 0.3)
    trims: list[tuple[str, float, int]] = []

    def recording_trim() -> bool:    # the real trim, recorded: which thread, when, with how many requests running
        trims.append((threading.current_thread().name, time.monotonic(),
                      llm.engine.scheduler.num_running))
        return release_free_heap()

    monkeypatch.setattr(async_llm, "release_free_heap", recording_trim)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run():
        allm = AsyncLLM(llm.config, engine=llm.engine, frontend=llm.frontend)

        async def generate(rid: str) -> list[int]:
            stream = await allm.add_request(rid, [1000, 1001, 1002, 1003], params)
            return [t for out in [o async for o in stream] for t in out.new_token_ids]

        assert len(await generate("a")) == 4
        finished = time.monotonic()
        await asyncio.sleep(0.1)
        assert trims == []                     # not yet idle for long enough
        # a request during the wait is served at once, and restarts the idle clock
        assert len(await generate("b")) == 4
        second = time.monotonic()
        await asyncio.sleep(1.0)
        assert len(trims) == 1                 # once, after the idle time, not again while nothing ran
        name, at, running = trims[0]
        assert name.startswith("pdpool-engine") and running == 0
        assert at - second >= 0.3 - 0.05 and at > finished
        assert len(await generate("c")) == 4   # serving goes on after a trim
        await asyncio.sleep(0.8)
        assert len(trims) == 2
        await allm.shutdown()

    asyncio.run(run())
