"""The router's Prometheus metrics (its own registry)."""

from __future__ import annotations

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
        for d in DECISIONS:
            self.requests.labels(d)
        self.responses = Counter("pdpool_router_responses", "Responses by HTTP status.", ["status"], registry=r)
        self.decision_seconds = Histogram(
            "pdpool_router_decision_seconds", "Routing decision latency (candidates, prefix lookup, plugins).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r)
        self.upstream_errors = Counter("pdpool_router_upstream_errors", "Failed legs by node and kind (connect, "
                                       "timeout, http_5xx, http_429, stream_broken).", ["node", "kind"], registry=r)
        self.index_mode = Gauge("pdpool_router_index_mode", "1 for the prefix index's current mode.", ["mode"],
                                registry=r)
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
        for role in ("prefill", "decode"):
            for c in (self.prompt_tokens, self.predicted_hit_tokens, self.realized_hit_tokens):
                c.labels(role)
        if pool is not None:
            r.register(_PoolCollector(pool, inflight))

    def set_index_mode(self, mode: str) -> None:
        for m in INDEX_MODES:
            self.index_mode.labels(m).set(1 if m == mode else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """Nodes and in-flight requests, read at scrape time."""

    def __init__(self, pool, inflight) -> None:
        self.pool = pool
        self.inflight = inflight

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
        inflight = GaugeMetricFamily("pdpool_router_inflight_requests", "Legs in flight per node.", labels=["node"])
        if self.inflight is not None:
            for node, n in sorted(self.inflight.requests.items()):
                inflight.add_metric([node], n)
        yield inflight
