"""Scheduler: batching, chunked prefill, preemption, priority, abort, stop rules, remote-KV hooks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdpool.config import SchedulerConfig
from pdpool.engine.kv_cache_manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

BLOCK = 4
EOS = 2


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, policy="fcfs",
                   max_model_len=None, caching=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          scheduling_policy=policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, BLOCK, caching), max_model_len=max_model_len)


def make_request(request_id: str, prompt=5, *, max_tokens=16, priority=0, arrival=None, **kw) -> Request:
    """``prompt``: token ids, or a length (ids 10, 11, ... offset by the id's hash-free ordinal)."""
    params_kw = {k: kw.pop(k) for k in ("ignore_eos", "stop_token_ids", "min_tokens") if k in kw}
    if isinstance(prompt, int):
        prompt = [100 + sum(map(ord, request_id)) * 50 + i for i in range(prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params_kw), eos_token_id=EOS,
                   priority=priority, arrival_time=0.0 if arrival is None else arrival, **kw)


def sample_for(out: SchedulerOutput, tokens: dict[str, int] | None = None) -> dict[str, int]:
    tokens = tokens or {}
    return {s.request.request_id: tokens.get(s.request.request_id, 1000 + s.request.num_output_tokens)
            for s in out.scheduled if s.samples}


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, sample_for(out, tokens))


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def assert_all_free(sched: Scheduler) -> None:
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sched.kv.req_blocks == {}


def test_prefill_then_decode_in_one_batch_until_length():
    sched = make_scheduler()
    a, b = make_request("a", 6, max_tokens=3), make_request("b", 3, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, got = step(sched)
    assert plan(out) == [("a", 6), ("b", 3)] and all(s.samples for s in out.scheduled)
    assert out.scheduled[0].block_ids == [0, 1] and out.scheduled[1].block_ids == [2]
    assert got == [a, b] and a.output_token_ids == [1000] and a.num_computed_tokens == 6
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    _, got = step(sched)
    assert got == [a, b] and a.is_finished and a.finish_reason == "length" and a.status.name == "FINISHED_LENGTH_CAPPED"
    assert a.output_token_ids == [1000, 1001, 1002]
    assert sched.num_running == 0 and not sched.has_unfinished_requests()
    assert_all_free(sched)
    assert sched.schedule().finished_ids == ["a", "b"]


def test_chunked_prefill_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=4)
    r = make_request("r", 10)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        out, got = step(sched)
        chunks.append((plan(out), out.scheduled[0].samples, got))
    assert chunks == [([("r", 4)], False, []), ([("r", 4)], False, []), ([("r", 2)], True, [r])]
    assert r.num_computed_tokens == 10 and r.num_output_tokens == 1
    assert sched.num_prefill_chunks == 2


def test_decode_first_then_a_chunk_of_a_waiting_prompt():
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add_request(make_request("d", 3))
    step(sched)
    sched.add_request(make_request("p", 9))
    out, _ = step(sched)
    assert plan(out) == [("d", 1), ("p", 4)] and out.num_batched_tokens == 5
    out, _ = step(sched)
    assert plan(out) == [("d", 1), ("p", 4)]
    out, _ = step(sched)
    assert plan(out) == [("d", 1), ("p", 1)] and out.scheduled[1].samples
    assert sched.num_prefill_chunks == 2


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    out, _ = step(sched)
    assert plan(out) == [("a", 3), ("b", 3)] and sched.num_waiting == 1 and sched.num_running == 2
    out, _ = step(sched)  # a and b finish here
    assert plan(out) == [("a", 1), ("b", 1)]
    out, _ = step(sched)
    assert plan(out) == [("c", 3)]


def test_preemption_by_recompute_fcfs_then_resume_with_prefix_hit():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # 2 blocks each: all 4 used
    out, _ = step(sched)  # token 8 of each still fits in their second block
    assert plan(out) == [("a", 1), ("b", 1)] and sched.num_free_blocks == 0
    out, _ = step(sched)  # a needs a third block: b (the latest) is preempted
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and sched.num_waiting == 1 and b.output_token_ids == [1000, 1001]
    assert a.is_finished and a.num_output_tokens == 3
    out, _ = step(sched)  # b resumes: prompt + outputs recomputed, its first block still cached
    assert plan(out) == [("b", 9 - 4)] and out.scheduled[0].samples
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 9 and b.output_token_ids == [1000, 1001, 1002]
    while sched.has_unfinished_requests():
        step(sched)
    assert b.num_output_tokens == 8 and b.finish_reason == "length"
    assert_all_free(sched)


def test_preemption_puts_victims_back_at_the_front_in_order():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=8))
    sched.add_request(make_request("d", 4))
    out, _ = step(sched)  # a, b, c: one block each; d does not fit
    assert plan(out) == [("a", 4), ("b", 4), ("c", 4)]
    out, _ = step(sched)  # a needs a block: c goes, then a's growth fits... b needs one too: b goes
    assert [r.request_id for r in out.preempted] == ["c", "b"] and plan(out) == [("a", 1)]
    assert [sched.waiting.pop().request_id for _ in range(3)] == ["b", "c", "d"]


def test_priority_order_and_lowest_priority_victim():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("low", 3, priority=5, arrival=0.0, max_tokens=1))
    sched.add_request(make_request("high", 3, priority=0, arrival=1.0, max_tokens=1))
    sched.add_request(make_request("high-later", 3, priority=0, arrival=2.0, max_tokens=1))
    order = [plan(step(sched)[0])[0][0] for _ in range(3)]
    assert order == ["high", "high-later", "low"]

    sched = make_scheduler(num_blocks=4, policy="priority")
    low, high = make_request("low", 5, priority=5, arrival=0.0), make_request("high", 8, priority=0, arrival=1.0)
    sched.add_request(low)
    step(sched)
    sched.add_request(high)
    out, _ = step(sched)
    assert plan(out) == [("low", 1), ("high", 8)] and sched.num_free_blocks == 0
    out, _ = step(sched)  # high needs a block; low, scheduled earlier in this step, is the victim
    assert out.preempted == [low] and plan(out) == [("high", 1)]
    assert low.status == RequestStatus.PREEMPTED and sched.running == [high]


def _loading_request(sched: Scheduler, rid: str, **kw) -> Request:
    r = make_request(rid, 10, kv_load={"peer": "p0"}, output_token_ids=[42], **kw)
    sched.add_request(r)
    out = sched.schedule()
    assert out.scheduled == [] and [(q.request_id, n) for q, n, _ in out.kv_loads_to_start] == [(rid, 0)]
    return r


def test_abort_in_every_state():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    running, chunked, waiting = make_request("running", 3), make_request("chunked", 9), make_request("waiting", 3)
    sched.add_request(running)
    sched.add_request(chunked)
    out, _ = step(sched)
    assert plan(out) == [("running", 3), ("chunked", 1)]
    sched.add_request(waiting)
    done = sched.finish_requests(["waiting", "chunked", "nope"], RequestStatus.FINISHED_ABORTED)
    assert done == [waiting, chunked] and sched.num_waiting == 0 and sched.running == [running]
    out = sched.schedule()
    sched.finish_requests("running", RequestStatus.FINISHED_ABORTED)  # between schedule and update: skipped
    assert sched.update_from_output(out, sample_for(out)) == [] and running.num_output_tokens == 1
    assert sched.finish_requests("running", RequestStatus.FINISHED_ABORTED) == []  # finished: no-op
    assert all(r.finish_reason == "abort" for r in (running, chunked, waiting))
    assert_all_free(sched)
    with pytest.raises(ValueError):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_abort_while_waiting_for_remote_kvs():
    sched = make_scheduler()
    loading = _loading_request(sched, "loading")
    assert sched.num_free_blocks == 64 - 3 and loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.finish_requests("loading", RequestStatus.FINISHED_ABORTED) == [loading]
    assert loading.finish_reason == "abort" and sched.num_waiting == 0
    assert not sched.finish_remote_load("loading", True)
    assert_all_free(sched)


def test_abort_a_preempted_request():
    sched = make_scheduler(num_blocks=2)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [b]
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.finish_reason == "abort" and sched.num_waiting == 0
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_stop_rules():
    sched = make_scheduler()
    eos = make_request("eos", 3)
    ignore = make_request("ignore", 3, ignore_eos=True, max_tokens=2)
    stop_id = make_request("stop-id", 3, stop_token_ids=[77])
    min_tok = make_request("min", 3, min_tokens=2)
    for r in (eos, ignore, stop_id, min_tok):
        sched.add_request(r)
    step(sched, {"eos": EOS, "ignore": EOS, "stop-id": 77, "min": EOS})
    assert (eos.finish_reason, eos.stop_reason, eos.output_token_ids) == ("stop", None, [EOS])
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", 77)
    assert not ignore.is_finished and not min_tok.is_finished
    step(sched, {"ignore": EOS, "min": EOS})
    assert ignore.finish_reason == "length" and min_tok.finish_reason == "stop"
    assert_all_free(sched)


def test_eos_at_max_tokens_is_stop_and_max_model_len_caps():
    sched = make_scheduler(max_model_len=8)
    a = make_request("a", 3, max_tokens=1)
    b = make_request("b", 5, max_tokens=None)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, {"a": EOS})
    assert a.finish_reason == "stop"
    while sched.has_unfinished_requests():
        step(sched)
    assert b.finish_reason == "length" and b.num_tokens == 8 and b.num_output_tokens == 3
    with pytest.raises(ValueError):
        sched.add_request(make_request("long", 9))
    sched.add_request(make_request("dup", 3))
    with pytest.raises(ValueError):
        sched.add_request(make_request("dup", 3))


def test_cap_is_at_most_the_kv_capacity():
    sched = make_scheduler(num_blocks=2, max_model_len=1000)
    assert sched.max_model_len == 8
    r = make_request("r", 6, max_tokens=None)
    sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched)
    assert r.num_tokens == 8 and r.finish_reason == "length" and sched.num_preemptions == 0


def test_stop_string_finish():
    sched = make_scheduler()
    r = make_request("r", 3)
    sched.add_request(r)
    step(sched)
    assert sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED) == [r]
    assert r.finish_reason == "stop" and sched.num_running == 0
    assert_all_free(sched)


def test_given_first_output_token_is_computed_with_the_prompt():
    sched = make_scheduler()
    r = make_request("r", 5, output_token_ids=[42], max_tokens=3)
    sched.add_request(r)
    out, _ = step(sched)
    assert plan(out) == [("r", 6)] and r.output_token_ids == [42, 1001]


def test_prefix_cache_counters():
    sched = make_scheduler()
    prompt = list(range(10, 20))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(b)
    out, _ = step(sched)
    assert plan(out) == [("b", 2)] and b.num_cached_tokens == 8
    assert (sched.prefix_cache_queried_tokens, sched.prefix_cache_hit_tokens) == (20, 8)


def test_remote_load_success_with_a_local_prefix_hit():
    sched = make_scheduler()
    prompt = list(range(10, 20))
    sched.add_request(make_request("local", prompt[:9], max_tokens=1))
    step(sched)  # caches blocks of tokens 0..7
    r = make_request("remote", prompt, kv_load="handle", output_token_ids=[42], max_tokens=3)
    sched.add_request(r)
    out = sched.schedule()
    [(req, num_hit, block_ids)] = out.kv_loads_to_start
    assert req is r and num_hit == 8 and len(block_ids) == 3 and block_ids[:2] == [0, 1]
    assert out.scheduled == [] and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (sched.num_waiting, sched.num_running) == (1, 0)
    assert sched.schedule().kv_loads_to_start == [] and sched.kv.get_block_ids("remote") == block_ids
    assert sched.finish_remote_load("remote", success=True)
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 10
    out, _ = step(sched)
    assert plan(out) == [("remote", 1)] and out.scheduled[0].samples and r.output_token_ids == [42, 1001]
    assert out.scheduled[0].block_ids == block_ids
    assert not sched.finish_remote_load("remote", success=True)


def test_remote_load_success_without_a_known_token_recomputes_the_last_prompt_token():
    sched = make_scheduler()
    r = make_request("r", 8, kv_load="handle")
    sched.add_request(r)
    [(_, num_hit, block_ids)] = sched.schedule().kv_loads_to_start
    assert num_hit == 0 and len(block_ids) == 2
    sched.finish_remote_load("r", True)
    assert r.num_computed_tokens == 7
    stored, _ = sched.kv.take_events()
    assert stored == r.block_hashes[:1]  # block 1 is full only once token 7 is computed
    out, _ = step(sched)
    assert plan(out) == [("r", 1)] and r.num_output_tokens == 1
    assert sched.kv.take_events()[0] == r.block_hashes[1:2]


def test_remote_load_failure_recomputes_from_the_local_hit():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=4)
    r = _loading_request(sched, "r", max_tokens=2)
    assert sched.finish_remote_load("r", success=False)
    assert r.num_computed_tokens == 0 and sched.kv.get_block_ids("r") == [0, 1, 2]
    outs = [plan(step(sched)[0]) for _ in range(3)]
    assert outs == [[("r", 4)], [("r", 4)], [("r", 3)]] and r.output_token_ids == [42, 1001]
    assert r.finish_reason == "length"
    assert_all_free(sched)


def test_a_preempted_loaded_request_is_recomputed_not_reloaded():
    sched = make_scheduler(num_blocks=4)
    first = make_request("first", 3, max_tokens=3)
    sched.add_request(first)
    step(sched)
    r = make_request("r", 10, kv_load="handle", output_token_ids=[42], max_tokens=2)
    sched.add_request(r)
    out, _ = step(sched)
    assert plan(out) == [("first", 1)] and [q.request_id for q, _, _ in out.kv_loads_to_start] == ["r"]
    assert sched.num_free_blocks == 0
    sched.finish_remote_load("r", success=True)
    out, _ = step(sched)  # first needs a second block: r, the latest running, is preempted
    assert out.preempted == [r] and plan(out) == [("first", 1)] and r.status == RequestStatus.PREEMPTED
    out, _ = step(sched)
    assert out.kv_loads_to_start == [] and plan(out) == [("r", 11 - 8)]  # its two full blocks were cached
    while sched.has_unfinished_requests():
        assert step(sched)[0].kv_loads_to_start == []
    assert r.output_token_ids == [42, 1001] and r.num_preemptions == 1
    assert_all_free(sched)


def test_remote_loads_use_no_token_budget_but_count_against_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    sched.add_request(make_request("x", 10, kv_load="h1"))
    sched.add_request(make_request("y", 10, kv_load="h2"))
    sched.add_request(make_request("z", 3))
    out = sched.schedule()
    assert [q.request_id for q, _, _ in out.kv_loads_to_start] == ["x", "y"] and out.scheduled == []
    sched.finish_remote_load("y", True)
    out, _ = step(sched)
    assert plan(out) == [("y", 1)]


def test_held_blocks_on_finish():
    sched = make_scheduler()
    r = make_request("r", 9, max_tokens=1, hold_blocks_on_finish=True)
    sched.add_request(r)
    out, got = step(sched)
    ids = out.scheduled[0].block_ids
    assert got == [r] and r.finish_reason == "length"
    assert sched.held_blocks == {"r": ids} and sched.num_free_blocks == 64 - 3
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_held == [r] and sched.schedule().finished_held == []
    assert sched.finish_requests("r", RequestStatus.FINISHED_ABORTED) == []  # already finished
    assert sched.release_held_blocks("r") and sched.held_blocks == {}
    assert not sched.release_held_blocks("r") and not sched.release_held_blocks("unknown")
    assert_all_free(sched)


def test_held_blocks_survive_pressure_and_stop_strings_hold_but_aborts_free():
    sched = make_scheduler(num_blocks=2)
    held = make_request("held", 8, hold_blocks_on_finish=True)
    sched.add_request(held)
    step(sched)
    sched.finish_requests("held", RequestStatus.FINISHED_STOPPED)
    assert list(sched.held_blocks) == ["held"] and sched.num_free_blocks == 0  # 8 computed tokens: 2 blocks
    sched.add_request(make_request("next", 3))
    assert sched.schedule().scheduled == []  # held blocks cannot be taken
    sched.release_held_blocks("held")
    assert plan(sched.schedule()) == [("next", 3)]

    sched = make_scheduler()
    r = make_request("r", 5, hold_blocks_on_finish=True)
    sched.add_request(r)
    step(sched)
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.held_blocks == {}
    assert_all_free(sched)


def test_scheduled_request_samples():
    r = make_request("r", 10)
    assert not ScheduledRequest(r, 4, []).samples
    r.num_computed_tokens = 6
    assert ScheduledRequest(r, 4, []).samples and ScheduledRequest(r, 4, []).start == 6


def test_the_core_never_imports_torch():
    code = ("import sys, pdpool.engine.scheduler, pdpool.engine.kv_cache_manager, pdpool.engine.block_pool, "
            "pdpool.engine.request; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampled_tokens_may_be_objects_with_token_id():
    from dataclasses import dataclass

    @dataclass
    class Sampled:
        token_id: int

    sched = make_scheduler()
    r = make_request("r", 3)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.update_from_output(out, {"r": Sampled(77)}) == [r] and r.output_token_ids == [77]
