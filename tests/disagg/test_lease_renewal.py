"""A decode node that queues handoffs keeps their leases alive: the prefill work is used, not recomputed.

Nodes: ``pr`` prefill with a 1 s lease, ``dr`` decode with ``--max-num-seqs 1``, so handoffs wait there one after
another for longer than the lease. Before renewal, the later ones found their leases expired and recomputed the
prompt (the prefill node's blocks freed by expiry, its work wasted).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster import assert_no_leaks, completion_body, token_ids
from proxy import DisaggProxy

LEASE_S = 1.0
PROMPTS = [f"Request {i}: once upon a time, in a small village at the edge of a dark forest, there lived a"
           for i in range(4)]


@pytest.fixture(scope="module")
def nodes(start_nodes):
    return start_nodes({"pr": ("prefill", ["--kv-lease-seconds", str(LEASE_S)]),
                        "dr": ("decode", ["--kv-lease-seconds", str(LEASE_S), "--max-num-seqs", "1"])})


def test_queued_handoffs_keep_their_leases(nodes):
    pr, dr = nodes["pr"], nodes["dr"]
    start = {n.name: n.kv()["free"] for n in nodes.values()}
    bodies = [completion_body(p, 48, ignore_eos=True) for p in PROMPTS]
    expected = [token_ids(dr.complete(b)) for b in bodies]  # colocated, on the decode node
    proxy = DisaggProxy(pr.url, dr.url)
    before_pr, before_dr = pr.kv(), dr.kv()
    # Each handle goes to the decode node as soon as it is issued, as a router sends it; there they queue one after
    # another for longer than the lease. (Prefilling all four first left the first lease to run out before any
    # decode began whenever the four prefills took over a second: a slow or loaded machine, not a missed renewal.)
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: proxy.decode(b, proxy.handle(b)), bodies))
    assert [r.status_code for r in replies] == [200] * len(bodies), [r.text for r in replies]
    assert [token_ids(r.json()) for r in replies] == expected
    after_pr, after_dr = pr.kv(), dr.kv()
    assert after_pr["expiries"] == before_pr["expiries"]
    assert after_dr["recomputes"] == before_dr["recomputes"]
    assert after_dr["ok"] == before_dr["ok"] + len(bodies)
    assert pr.value("pdpool_kv_lease_renewals_total") > 0  # they did wait past the lease
    assert_no_leaks(nodes.values(), start)
