"""The load shape of one run: when each request is sent, under a request count and a time limit.

``rate=None`` sends every request at once; a rate draws Poisson arrivals (exponential gaps, seeded), or gamma
gaps of the same mean with a ``burstiness`` other than 1.
``concurrency`` caps the requests in flight: alone, it is a closed loop of that many clients. At the time limit no
new request starts and the ones in flight are cancelled (recorded with the error ``time limit``).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable

from tqdm import tqdm

from pdpool.bench.stats import RequestRecord

TIME_LIMIT_ERROR = "time limit"


def arrival_times(num: int, rate: float | None, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is due: gaps of mean ``1/rate``, gamma-distributed of shape
    ``burstiness`` (vLLM's ``--burstiness``: 1 is Poisson, less is burstier, more is steadier)."""
    if rate is None:
        return [0.0] * num
    if not rate > 0 or not burstiness > 0:
        raise ValueError("the request rate and the burstiness must be > 0")
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


async def run_load(num: int, send: Callable[[int, float], Awaitable[RequestRecord]],
                   new_record: Callable[[int, float], RequestRecord], *, rate: float | None,
                   concurrency: int | None, time_limit: float, seed: int = 0, burstiness: float = 1.0,
                   progress: bool = True, desc: str = "bench") -> tuple[list[RequestRecord], float]:
    """Send requests ``0..num-1``: ``send(i, send_time)`` returns the filled record, ``new_record(i, send_time)``
    makes the record of one cut by the time limit. Returns the records (in index order, requests never sent are
    absent) and the run's duration: from the start to the last response, or the time limit when it cut the run."""
    due = arrival_times(num, rate, seed, burstiness)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    start = time.perf_counter()
    deadline = start + time_limit
    in_flight: dict[int, float] = {}
    records: dict[int, RequestRecord] = {}
    last_end = start
    bar = tqdm(total=num, desc=desc, unit="req", disable=not progress, leave=False)

    async def one(i: int) -> None:
        nonlocal last_end
        delay = start + due[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        try:
            if time.perf_counter() >= deadline:
                return
            in_flight[i] = time.perf_counter() - start
            records[i] = await send(i, in_flight[i])
            del in_flight[i]
            last_end = max(last_end, time.perf_counter())
            bar.update(1)
        finally:
            if gate is not None:
                gate.release()

    tasks = [asyncio.ensure_future(one(i)) for i in range(num)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    finally:  # the time limit, or this run cancelled (Ctrl-C): no request outlives it, nor its caller's session
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    for task in tasks:  # a bug in send must not pass for a slow server
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    for i, send_time in in_flight.items():
        record = new_record(i, send_time)
        record.error = TIME_LIMIT_ERROR
        records[i] = record
    duration = (time.perf_counter() if pending else last_end) - start
    return [records[i] for i in sorted(records)], duration
