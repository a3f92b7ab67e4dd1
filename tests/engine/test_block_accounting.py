"""Property tests: across random add/step/abort/preempt/remote-load/release sequences no block leaks or is
freed twice, every ref count equals the number of live block tables holding the block, the KV events replay
to exactly the cached hash set, and once everything is finished every block is free again."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdpool.config import SchedulerConfig
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import Scheduler

BLOCK = 4
EOS = 2
PREFIXES = [[], list(range(10, 18)), list(range(10, 14)) + [50, 51, 52, 53]]  # shared prefixes hit the cache


def make_request(request_id: str, prompt: list[int], *, max_tokens: int, priority: int, kv_load: bool,
                 hold: bool, first_token: int | None, salt: str | None) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS, priority=priority,
                   arrival_time=0.0, cache_salt=salt, kv_load="handle" if kv_load else None,
                   hold_blocks_on_finish=hold, output_token_ids=() if first_token is None else [first_token])


class BlockAccounting(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 12), budget=st.integers(1, 24), max_num_seqs=st.integers(1, 4),
                policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans())
    def setup(self, num_blocks, budget, max_num_seqs, policy, caching):
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, scheduling_policy=policy)
        self.sched = Scheduler(cfg, KVCacheManager(num_blocks, BLOCK, caching))
        self.ids = itertools.count()
        self.all: dict[str, Request] = {}
        self.published: set[bytes] = set()

    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(3, 9), max_size=10),
          max_tokens=st.integers(1, 6), priority=st.integers(0, 2), kv_load=st.booleans(), hold=st.booleans(),
          salt=st.sampled_from([None, None, "t"]))
    def add(self, data, prefix, tail, max_tokens, priority, kv_load, hold, salt):
        prompt = (prefix + tail)[:self.sched.max_model_len - 1] or [5]
        first = data.draw(st.one_of(st.none(), st.integers(3, 9))) if kv_load else None
        rid = f"r{next(self.ids)}"
        self.all[rid] = make_request(rid, prompt, max_tokens=max_tokens, priority=priority, kv_load=kv_load,
                                     hold=hold, first_token=first, salt=salt)
        self.sched.add_request(self.all[rid])

    @rule(eos=st.booleans(), abort_between=st.booleans(), data=st.data(), steps=st.integers(1, 4))
    def step(self, eos, abort_between, data, steps):
        for _ in range(steps):
            self._step(eos, abort_between, data)

    def _step(self, eos, abort_between, data):
        out = self.sched.schedule()
        for s in out.scheduled:
            assert s.request.status == RequestStatus.RUNNING
            assert len(s.block_ids) * BLOCK >= s.start + s.num_new_tokens
        if abort_between and out.scheduled:
            victim = data.draw(st.sampled_from(out.scheduled)).request
            self.sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        sampled = {s.request.request_id: EOS if eos else 7 for s in out.scheduled if s.samples}
        self.sched.update_from_output(out, sampled)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data(), stop=st.booleans())
    def finish(self, data, stop):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        status = RequestStatus.FINISHED_STOPPED if stop else RequestStatus.FINISHED_ABORTED
        assert self.sched.finish_requests([rid], status) == [self.all[rid]]

    @precondition(lambda self: self.sched.loading)
    @rule(data=st.data(), success=st.booleans())
    def finish_remote_load(self, data, success):
        rid = data.draw(st.sampled_from(sorted(self.sched.loading)))
        assert self.sched.finish_remote_load(rid, success)

    @rule(data=st.data())
    def release_held(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.held_blocks) + ["unknown"]))
        assert self.sched.release_held_blocks(rid) == (rid != "unknown")

    @invariant()
    def books_balance(self):
        if not hasattr(self, "sched"):
            return
        sched, kv = self.sched, self.sched.kv
        tables = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
        for block in kv.pool.blocks:
            assert block.ref_cnt == tables[block.block_id], block
        free = kv.pool.free_queue.block_ids()
        assert len(free) == len(set(free)) == kv.num_free_blocks
        assert set(free) == {b.block_id for b in kv.pool.blocks if b.ref_cnt == 0}
        holders = {r.request_id for r in sched.running} | set(sched.loading) | set(sched.held_blocks)
        assert set(kv.req_blocks) == holders
        for r in sched.running:
            assert len(kv.req_blocks[r.request_id]) * BLOCK >= r.num_computed_tokens
        for rid, ids in sched.held_blocks.items():
            assert kv.get_block_ids(rid) == ids
        for block_hash, block in kv.pool.cached.items():
            assert block.block_hash == block_hash
        assert sum(b.block_hash is not None for b in kv.pool.blocks) == len(kv.pool.cached)
        stored, removed = kv.take_events()
        assert self.published.isdisjoint(stored) and set(removed) <= self.published
        self.published = (self.published | set(stored)) - set(removed)
        assert self.published == set(kv.pool.cached)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(200):  # drain: everything runs to completion (no livelock)
            if not sched.requests:
                break
            for rid in list(sched.loading):
                sched.finish_remote_load(rid, True)
            for rid in list(sched.held_blocks):  # leases end; otherwise they may starve the rest
                sched.release_held_blocks(rid)
            out = sched.schedule()
            sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        assert not sched.requests, sched.requests
        for rid in list(sched.held_blocks):
            sched.release_held_blocks(rid)
        assert sched.num_free_blocks == sched.num_total_blocks and sched.kv.req_blocks == {}
        assert all(r.is_finished and r.finish_reason in ("stop", "length", "abort") for r in self.all.values())


BlockAccounting.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestBlockAccounting = BlockAccounting.TestCase
