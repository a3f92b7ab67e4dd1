"""Counters of KV transfer between nodes, exported on the node's /metrics.

Plain attributes bumped by the prefill and decode sides (engine thread or event loop; increments under
the GIL), read at scrape time by ``KVMetricsCollector``; the latency histogram is a prometheus one.
"""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OUTCOMES = ("ok", "recompute", "fail")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVMetrics:
    def __init__(self) -> None:
        self.transfers = dict.fromkeys(OUTCOMES, 0)
        self.recomputes = 0
        self.lease_expiries = 0
        self.lease_renewals = 0
        self.leased_blocks = lambda: 0   # set by the prefill side
        self.num_leases = lambda: 0
        self.bytes_pulled = lambda: 0    # set by the worker
        self.bytes_pushed = lambda: 0
        self.peers_loaded = lambda: 0    # set by the node: peer agents its NIXL agent holds
        self.peers_removed = lambda: 0   # and those its peer sweep removed
        self.latency = Histogram("pdpool_kv_transfer_seconds", "KV transfer of one request, start to confirmation.",
                                 buckets=_BUCKETS, registry=None)

    def register(self, registry) -> None:
        registry.register(self.latency)
        registry.register(KVMetricsCollector(self))

    def outcome(self, outcome: str) -> None:
        self.transfers[outcome] += 1
        if outcome == "recompute":
            self.recomputes += 1


class KVMetricsCollector:
    def __init__(self, m: KVMetrics) -> None:
        self.m = m

    def collect(self):
        m = self.m
        yield CounterMetricFamily("pdpool_kv_pulled_bytes", "KV bytes this node READ from peers (pull).",
                                  value=m.bytes_pulled())
        yield CounterMetricFamily("pdpool_kv_pushed_bytes", "KV bytes this node WROTE into peers (push).",
                                  value=m.bytes_pushed())
        transfers = CounterMetricFamily("pdpool_kv_transfers", "Remote KV loads by outcome.", labels=["outcome"])
        for outcome, n in m.transfers.items():
            transfers.add_metric([outcome], n)
        yield transfers
        yield CounterMetricFamily("pdpool_kv_recomputes", "Remote KV loads given up and recomputed locally.",
                                  value=m.recomputes)
        yield CounterMetricFamily("pdpool_kv_lease_expiries", "Leases that ran out before a notification.",
                                  value=m.lease_expiries)
        yield CounterMetricFamily("pdpool_kv_lease_renewals", "Lease renewals by decode nodes that queue the handoff.",
                                  value=m.lease_renewals)
        yield GaugeMetricFamily("pdpool_kv_leased_blocks", "KV blocks held under lease for decode nodes.",
                                value=m.leased_blocks())
        yield GaugeMetricFamily("pdpool_kv_leases", "Leases currently held.", value=m.num_leases())
        yield GaugeMetricFamily("pdpool_kv_peers_loaded", "Peer NIXL agents this node's agent holds.",
                                value=m.peers_loaded())
        yield CounterMetricFamily("pdpool_kv_peers_removed", "Peer NIXL agents removed after their node left the pool.",
                                  value=m.peers_removed())
