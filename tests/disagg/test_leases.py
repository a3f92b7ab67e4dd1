"""The pure pieces, exactly: the lease table (fake clock) and the load plan (which blocks are moved)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpool.engine.kv_connector import plan_load
from pdpool.prefill_node.leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_notify_before_expiry_is_held_once():
    clock = Clock()
    table = LeaseTable(2.0, clock=clock)
    lease = table.issue("r1", [3, 4])
    clock.now += 1.9
    assert table.notify(lease.lease_id) == (True, lease)
    # A repeated notify is not held: the first one freed the blocks, which another request may have taken since.
    assert table.notify(lease.lease_id) == (False, None)
    assert table.expire() == [] and table.num_leased_blocks == 0


def test_expired_lease_is_not_held_even_before_expire_runs():
    clock = Clock()
    table = LeaseTable(2.0, clock=clock)
    lease = table.issue("r1", [3])
    clock.now += 2.0
    assert table.notify(lease.lease_id) == (False, None)
    assert table.expire() == [lease] and table.num_expired == 1
    assert table.notify(lease.lease_id) == (False, None)
    assert table.notify("unknown") == (False, None)


def test_cap_counts_leased_and_reserved_blocks():
    table = LeaseTable(5.0, max_blocks=5, clock=Clock())
    assert table.reserve("a", 3)
    assert not table.reserve("b", 3)
    table.issue("a", [0, 1, 2])
    assert not table.reserve("b", 3)
    assert table.reserve("b", 2)
    table.unreserve("b")
    assert table.reserve("c", 2) and table.num_leased_blocks == 3


class Handle:
    def __init__(self, remote_block_ids):
        self.remote_block_ids = remote_block_ids


@pytest.mark.parametrize("hit_tokens, local, remote", [
    (0, [7, 8, 9], [1, 2, 3]),     # nothing cached here: every block
    (16, [8, 9], [2, 3]),          # one cached block is not pulled
    (32, [9], [3]),                # only the partial last block
])
def test_plan_leaves_out_the_local_prefix_hit(hit_tokens, local, remote):
    plan = plan_load(Handle([1, 2, 3]), hit_tokens, [7, 8, 9, 10], 16)  # block 10: room for the decode
    assert (plan.local_ids, plan.remote_ids) == (local, remote)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["issue", "notify", "tick"]), st.integers(0, 7)), max_size=60))
def test_leased_block_count_is_the_sum_over_leases(ops):
    clock = Clock()
    table = LeaseTable(3.0, clock=clock)
    issued: list[str] = []
    for op, n in ops:
        if op == "issue":
            issued.append(table.issue(f"r{len(issued)}", list(range(n))).lease_id)
        elif op == "notify" and issued:
            table.notify(issued[n % len(issued)])
        else:
            clock.now += n * 0.5
            table.expire()
        assert table.num_leased_blocks == sum(len(lease.block_ids) for lease in table.leases.values())


def test_a_scrape_while_the_engine_thread_changes_leases():
    """The collector runs on the HTTP thread while the engine thread issues and ends leases."""
    import threading

    from pdpool.kv_metrics import KVMetrics, KVMetricsCollector

    table = LeaseTable(60.0)
    for i in range(2000):  # a long lease dict: an iteration over it would be interrupted
        table.issue(f"old{i}", [i])
    metrics = KVMetrics()
    metrics.leased_blocks = lambda: table.num_leased_blocks
    metrics.num_leases = lambda: len(table.leases)
    stop = threading.Event()

    def engine_thread():
        i = 0
        while not stop.is_set():
            table.notify(table.issue(f"r{i}", [1, 2, 3]).lease_id)
            i += 1

    thread = threading.Thread(target=engine_thread)
    thread.start()
    try:
        collector = KVMetricsCollector(metrics)
        for _ in range(300):
            values = {f.name: f.samples[0].value for f in collector.collect() if f.name.startswith("pdpool_kv_lease")}
            assert values["pdpool_kv_leased_blocks"] in (2000, 2003)
    finally:
        stop.set()
        thread.join()


def test_renew_restarts_the_duration_and_keeps_expiry_order():
    clock = Clock()
    table = LeaseTable(2.0, clock=clock)
    a, b = table.issue("a", [1]), table.issue("b", [2])
    clock.now += 1.5
    assert table.renew(a.lease_id) is a and table.remaining(a) == 2.0
    clock.now += 1.0  # b ran out, a (renewed) did not
    assert table.expire() == [b]
    assert table.notify(a.lease_id) == (True, a) and table.num_renewed == 1


def test_renew_never_revives_an_ended_lease():
    clock = Clock()
    table = LeaseTable(2.0, clock=clock)
    expired, notified = table.issue("a", [1]), table.issue("b", [2])
    table.notify(notified.lease_id)
    clock.now += 2.0
    assert table.renew(expired.lease_id) is None and table.renew(notified.lease_id) is None
    assert table.renew("unknown") is None and table.num_renewed == 0
    assert table.expire() == [expired] and table.num_leased_blocks == 0


def test_leases_of_a_response_are_its_engine_requests_only():
    """``<response id>-<8 hex>-<choice>`` (pdpool.server.serving): the response id is matched whole, dashes in it
    included, never as a mere prefix of another response's id."""
    table = LeaseTable(5.0, clock=Clock())
    mine = [table.issue(f"abc-1-0a1b2c3d-{i}", [i]).lease_id for i in range(2)]
    table.issue("abc-0a1b2c3d-0", [7])            # response "abc"
    table.issue("abc-10-0a1b2c3d-0", [8])         # response "abc-10"
    assert sorted(table.leases_of_response("abc-1")) == sorted(mine)
    assert len(table.leases_of_response("abc")) == 1 and table.leases_of_response("ab") == []
    for lease_id in mine:
        table.notify(lease_id)
    assert table.leases_of_response("abc-1") == []
