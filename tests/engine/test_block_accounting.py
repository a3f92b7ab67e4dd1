"""Property tests: across random add/step/abort/preempt/remote-load/release sequences no block leaks or is
freed twice, every ref count equals the number of live block tables holding the block, the KV events replay
to exactly the cached hash set, and once everything is finished every block is free again."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hypothesis_profiles import scaled
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


def drain_bound(sched: Scheduler) -> int:
    """Rounds within which ``drain`` must finish every request: the scheduler's progress argument, not a guess.

    At the start of a drain round no load is in flight and no lease holds blocks, so every used block belongs
    to a running request, and the head of ``running`` (scheduled first, budget >= 1) fits once the others are
    preempted: no request outgrows the cache (prompt <= max_model_len <= capacity, and the harness keeps
    prompt + first token <= max_model_len). FCFS preempts from the tail, so the head computes at least one token
    every round until it finishes: at most prompt + max_tokens rounds each, plus one round per remote load.
    The priority policy may preempt the head itself (it is then the worst key; one more round), and the next
    head has a better key, so between two finishes each request leads at most once: n + 1 times that bound.
    """
    requests = sched.requests.values()
    work = sum(r.num_prompt_tokens + r.max_tokens + 2 for r in requests)
    return work * (len(requests) + 1 if sched.waiting.by_priority else 1)


def drain(sched: Scheduler) -> int:
    """Run every unfinished request to completion; each round first ends the remote loads (successfully) and
    the leases, then runs one step sampling a non-stop token. Returns the rounds it took; fails on a livelock."""
    bound = drain_bound(sched)
    for rounds in range(bound + 1):
        if not sched.requests:
            return rounds
        for rid in list(sched.loading):
            sched.finish_remote_load(rid, True)
        for rid in list(sched.held_blocks):  # leases end; otherwise they may starve the rest
            sched.release_held_blocks(rid)
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    raise AssertionError(f"livelock: unfinished after {bound} rounds: {sched.requests}")


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
        assert kv.req_block_ids == {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_blocks.items()}
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
        drain(sched)
        for rid in list(sched.held_blocks):
            sched.release_held_blocks(rid)
        assert sched.num_free_blocks == sched.num_total_blocks and sched.kv.req_blocks == {}
        assert all(r.is_finished and r.finish_reason in ("stop", "length", "abort") for r in self.all.values())


BlockAccounting.TestCase.settings = settings(max_examples=scaled(250), stateful_step_count=40)
TestBlockAccounting = BlockAccounting.TestCase


def fcfs_rounds(request: Request) -> int:
    """Drain rounds of one request alone under a one-token budget, without prefix caching: one per prompt token
    and per output token but the last (sampled, never computed); a remote load instead takes the round that
    starts it and one for the last prompt token (the rest arrives computed)."""
    if request.kv_load is not None:
        return 1 + request.max_tokens
    return request.num_prompt_tokens + request.max_tokens - 1


def test_a_long_queue_drains_under_a_one_token_budget():
    """The fresh-clone failure (seed 312135948058746821298179294727609467235) was the old fixed 200-round
    drain, not a livelock: with a one-token budget and one sequence the queue needed 201 rounds, and the last
    request was one step from finishing (computed = tokens - 1). Here the same setup, requests like the
    shrunk example's (remote loads, held blocks, shared prefixes), needs more than 200 rounds: exactly one
    after another, FCFS."""
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, scheduling_policy="fcfs")
    sched = Scheduler(cfg, KVCacheManager(3, BLOCK, False))
    shapes = [(PREFIXES[1], 1, False, False), (PREFIXES[2] + [3, 3, 3], 1, False, False), ([5], 4, True, False),
              ([3] * 9, 3, False, False), ([5], 1, True, True), ([5], 4, False, True)]
    requests = [make_request(f"r{i}", prompt, max_tokens=max_tokens, priority=0, kv_load=kv_load, hold=hold,
                             first_token=None, salt=None)
                for i, (prompt, max_tokens, kv_load, hold) in enumerate(shapes * 7)]
    for request in requests:
        sched.add_request(request)
    expected = sum(fcfs_rounds(r) for r in requests)
    assert 200 < expected <= drain_bound(sched)
    assert drain(sched) == expected
    assert all(r.finish_reason == "length" for r in requests)
    assert list(sched.held_blocks) == [requests[-1].request_id]  # the last one's lease has not ended yet
    assert sched.release_held_blocks(requests[-1].request_id)
    assert sched.num_free_blocks == sched.num_total_blocks
