"""The router's Prometheus metrics (its own registry).

With ``--workers N`` > 1 every worker writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's
multiprocess mode, set by the supervisor before any worker imports prometheus_client), and whichever worker
answers a scrape reads them all: counters and histograms are summed over the workers (those that exited
included), the in-flight gauge over the live ones, ``pdpool_router_index_mode`` is 1 for a mode some live worker
is in. ``pdpool_router_nodes`` is the answering worker's own view (every worker discovers the same nodes).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DECISIONS = ("disaggregated", "decode_only", "fallback", "retry")
INDEX_MODES = ("precise", "approximate")


class RouterMetrics:
    def __init__(self, pool=None, inflight=None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdpool_router_requests", "Routed requests by decision: disaggregated, decode_only, "
                                "fallback (prefill failed, served decode-only), retry (one per extra decode try).",
                                ["decision"], registry=r)
        # labels() hashes the values and takes a lock on every call: the children a request touches are kept
        self.decisions = {d: self.requests.labels(d) for d in DECISIONS}
        self.responses = Counter("pdpool_router_responses", "Responses by HTTP status.", ["status"], registry=r)
        self._responses: dict = {}
        self.decision_seconds = Histogram(
            "pdpool_router_decision_seconds", "Routing decision latency (candidates, prefix lookup, plugins).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r)
        self.upstream_errors = Counter("pdpool_router_upstream_errors", "Failed legs by node and kind (connect, "
                                       "timeout, http_5xx, http_429, stream_broken).", ["node", "kind"], registry=r)
        self.index_mode = Gauge("pdpool_router_index_mode", "1 for the prefix index's current mode.", ["mode"],
                                registry=r, multiprocess_mode="livemax")
        self.index_degradations = Counter("pdpool_router_index_degradations", "Switches from the precise (Redis) "
                                          "to the approximate (router-local) prefix index.", registry=r)
        self.prompt_tokens = Counter("pdpool_router_prompt_tokens", "Prompt tokens sent, by leg role.", ["role"],
                                     registry=r)
        self.predicted_hit_tokens = Counter(
            "pdpool_router_prefix_predicted_hit_tokens", "Prompt tokens the index said the chosen node holds.",
            ["role"], registry=r)
        self.realized_hit_tokens = Counter(
            "pdpool_router_prefix_realized_hit_tokens", "Prompt tokens the node served from its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens).", ["role"], registry=r)
        self.affinity_yields = Counter("pdpool_router_affinity_yields", "Decisions where prefix affinity yielded "
                                       "to load (load-margin-filter).", registry=r)
        self.lease_releases = Counter("pdpool_router_lease_releases", "Prefill leases the router released at once "
                                      "(client gone, or the decode leg failed).", registry=r)
        self.inflight = Gauge("pdpool_router_inflight_requests", "Legs in flight per node.", ["node"], registry=r,
                              multiprocess_mode="livesum")
        self.hit_tokens = {role: tuple(c.labels(role) for c in (self.prompt_tokens, self.predicted_hit_tokens,
                                                                 self.realized_hit_tokens))
                           for role in ("prefill", "decode")}   # (prompt, predicted, realized) per leg role
        if inflight is not None:
            inflight.gauge = self.inflight
            for node_id, n in inflight.requests.items():  # legs routed before the metrics existed
                self.inflight.labels(node_id).inc(n)
        self.pool = pool
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        if self.multiprocess:  # a scrape reads every worker's files, plus this worker's view of the nodes
            from prometheus_client import multiprocess

            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry)
        if pool is not None:
            self.registry.register(_PoolCollector(pool))

    def count_response(self, status: int) -> None:
        child = self._responses.get(status)
        if child is None:     # labels() hashes and locks on every call: each status's child is kept
            child = self._responses[status] = self.responses.labels(str(status))
        child.inc()

    def set_index_mode(self, mode: str) -> None:
        for m in INDEX_MODES:
            self.index_mode.labels(m).set(1 if m == mode else 0)

    def render(self) -> bytes:
        if self.pool is not None:  # every known node has a series, 0 while idle (touching a child keeps its value)
            for node_id in list(self.pool.endpoints):
                self.inflight.labels(node_id)
        return generate_latest(self.registry)


class _PoolCollector:
    """Nodes, read at scrape time."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        nodes = GaugeMetricFamily("pdpool_router_nodes", "Known nodes by role and whether they are usable.",
                                  labels=["role", "usable"])
        counts: dict[tuple[str, str], int] = {}
        for e in self.pool.endpoints.values():
            key = (e.role, "true" if self.pool.usable(e) else "false")
            counts[key] = counts.get(key, 0) + 1
        for (role, usable), n in sorted(counts.items()):
            nodes.add_metric([role, usable], n)
        yield nodes
