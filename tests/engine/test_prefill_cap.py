"""The prompt-token cap while requests decode (``max_prefill_tokens_with_decodes``, off by default): a new prompt
beside running decodes is chunked across steps; alone, it takes the whole budget."""

from __future__ import annotations

from pdpool import config
from pdpool.config import SchedulerConfig
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.scheduler import Scheduler
from tests.engine.test_scheduler import BLOCK, assert_all_free, make_request, plan, step


def make_capped(cap, budget=64, num_blocks=64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_prefill_tokens_with_decodes=cap)
    return Scheduler(cfg, KVCacheManager(num_blocks, BLOCK, True))


def test_a_prompt_beside_decodes_is_chunked_to_the_cap():
    sched = make_capped(8)
    sched.add_request(make_request("a", 20, max_tokens=8, ignore_eos=True))
    out, _ = step(sched)
    assert plan(out) == [("a", 20)]  # nothing decodes yet: the whole budget
    sched.add_request(make_request("b", 20, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("c", 5, max_tokens=4, ignore_eos=True))
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        chunks.append(plan(out))
    # a decodes every step; b's prompt goes 8 + 8 + 4 and c waits until the cap has room
    assert chunks == [[("a", 1), ("b", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 4), ("c", 4)]]
    while sched.has_unfinished_requests():
        step(sched)
    assert_all_free(sched)


def test_no_cap_and_zero_take_the_whole_budget():
    for cap in (None, 0):
        sched = make_capped(cap)
        sched.add_request(make_request("a", 4, max_tokens=4, ignore_eos=True))
        step(sched)
        sched.add_request(make_request("b", 30, max_tokens=2, ignore_eos=True))
        out, _ = step(sched)
        assert plan(out) == [("a", 1), ("b", 30)]


def test_off_by_default_on_both_devices():
    """Measured on the CPU (docs/performance.md): a cap lowered TTFT but raised TPOT and lowered throughput."""
    for device in ("cpu", "cuda"):
        cfg = config.build(model="demo", device=device)
        assert cfg.scheduler.max_prefill_tokens_with_decodes is None
        assert cfg.scheduler.max_num_batched_tokens == 2048
