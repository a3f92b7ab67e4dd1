"""The router's per-request metrics kept in-process (router/metrics.py, ``_LocalCollector``) scrape exactly as
prometheus_client's own objects do: same families, names, labels, types, help and values."""

from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pdpool.router.endpoints import Endpoint, Pool
from pdpool.router.inflight import InflightTracker
from pdpool.router.metrics import DECISIONS, RouterMetrics

NODES = ("decode-0", "decode-1", "prefill-0")

op = st.one_of(
    st.tuples(st.just("response"), st.sampled_from([200, 400, 401, 404, 429, 500, 502, 503])),
    st.tuples(st.just("decision"), st.sampled_from(DECISIONS)),
    st.tuples(st.just("latency"), st.floats(0, 2, allow_nan=False) | st.sampled_from([0.0001, 0.00025, 0.5, 0.1])),
    st.tuples(st.just("hits"), st.sampled_from(["prefill", "decode"]), st.integers(0, 5000), st.integers(0, 5000)),
    st.tuples(st.just("leg"), st.sampled_from(NODES + ("gone-node",)), st.booleans()),
)


def scrape(local: bool, ops) -> str:
    pool, inflight = Pool(), InflightTracker()
    pool.replace("static", [Endpoint(n, f"http://{n}", "decode") for n in NODES[:2]])
    early = inflight.add("decode-1", 16)     # a leg routed before the metrics existed
    m = RouterMetrics(pool, inflight, local=local)
    open_legs = [early]
    for o in ops:
        if o[0] == "response":
            m.count_response(o[1])
        elif o[0] == "decision":
            m.decisions[o[1]].inc()
        elif o[0] == "latency":
            m.decision_seconds.observe(o[1])
        elif o[0] == "hits":
            prompt, predicted, realized = m.hit_tokens[o[1]]
            prompt.inc(o[2])
            predicted.inc(o[3])
            realized.inc(o[3] // 2)
        else:
            ticket = inflight.add(o[1], 10)
            if o[2]:
                ticket.done()
            else:
                open_legs.append(ticket)
    m.upstream_errors.labels("decode-0", "timeout").inc()
    m.set_index_mode("precise")
    m.responses.labels("418").inc()           # the prometheus_client interface (tests/test_dashboard.py)
    return m.render().decode()


def canonical(text: str) -> list[tuple]:
    """Every sample with its family's type and help; the _created series' times (when each was made) out."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            value = None if s.name.endswith("_created") else s.value
            out.append((fam.name, fam.type, fam.documentation, s.name, tuple(sorted(s.labels.items())), value))
    return sorted(out, key=repr)


@settings(max_examples=80, deadline=None)
@given(st.lists(op, max_size=40))
def test_local_families_scrape_as_prometheus_clients(ops):
    assert canonical(scrape(True, ops)) == canonical(scrape(False, ops))


def test_every_known_node_has_an_inflight_series():
    text = scrape(True, [("leg", "gone-node", True)])
    series = dict(re.findall(r'pdpool_router_inflight_requests\{node="([^"]+)"\} (\S+)', text))
    assert series == {"decode-1": "1.0", "gone-node": "0.0", "decode-0": "0.0"}
