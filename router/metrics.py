"""The router's Prometheus metrics (its own registry).

With ``--workers N`` > 1 every worker writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's
multiprocess mode, set by the supervisor before any worker imports prometheus_client), and whichever worker
answers a scrape reads them all: counters and histograms are summed over the workers (those that exited
included), the in-flight gauge over the live ones, ``pdpool_router_index_mode`` is 1 for a mode some live worker
is in. ``pdpool_router_nodes`` is the answering worker's own view (every worker discovers the same nodes).

With one process (the default), the families a request touches (requests by decision, responses by status, the
decision latency histogram, prompt and hit tokens by role, legs in flight by node) are plain counters in this
process, folded into the exposition at scrape time by ``_LocalCollector``: the same names, labels, types and
values, without prometheus_client's per-call checks and locks (about 4% of the router's CPU per request,
docs/performance.md, router overhead round 7). The legs in flight are read from the router's own count
(``InflightTracker.requests``, the very number the gauge mirrored). Multiprocess mode keeps prometheus_client's
objects: their values must reach the files the other workers read.
"""

from __future__ import annotations

import bisect
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DECISIONS = ("disaggregated", "decode_only", "fallback", "retry")
INDEX_MODES = ("precise", "approximate")
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class RouterMetrics:
    def __init__(self, pool=None, inflight=None, *, local: bool | None = None) -> None:
        """``local``: the per-request families kept in this process (default: unless multiprocess)."""
        r = self.registry = CollectorRegistry()
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        if local is None:
            local = not self.multiprocess
        local = self._local = _LocalCollector(inflight, pool) if local and not self.multiprocess else None
        if local is None:
            counter = lambda name, doc, labels: Counter(name, doc, labels, registry=r)  # noqa: E731
        else:
            counter = local.counter
        self.requests = counter("pdpool_router_requests", "Routed requests by decision: disaggregated, decode_only, "
                                "fallback (prefill failed, or its KV handle refused: served decode-only), retry (one per "
                                "extra decode try).",
                                ["decision"])
        # labels() hashes the values and takes a lock on every call: the children a request touches are kept
        self.decisions = {d: self.requests.labels(d) for d in DECISIONS}
        self.responses = counter("pdpool_router_responses", "Responses by HTTP status.", ["status"])
        self._responses: dict = {}
        doc = "Routing decision latency (candidates, prefix lookup, plugins)."
        self.decision_seconds = (Histogram("pdpool_router_decision_seconds", doc, buckets=DECISION_BUCKETS, registry=r)
                                 if local is None else local.histogram("pdpool_router_decision_seconds", doc,
                                                                       DECISION_BUCKETS))
        self.upstream_errors = Counter("pdpool_router_upstream_errors", "Failed legs by node and kind (connect, "
                                       "timeout, http_5xx, http_429, stream_broken).", ["node", "kind"], registry=r)
        self.index_mode = Gauge("pdpool_router_index_mode", "1 for the prefix index's current mode.", ["mode"],
                                registry=r, multiprocess_mode="livemax")
        self.index_degradations = Counter("pdpool_router_index_degradations", "Switches from the precise (Redis) "
                                          "to the approximate (router-local) prefix index.", registry=r)
        self.prompt_tokens = counter("pdpool_router_prompt_tokens", "Prompt tokens sent, by leg role.", ["role"])
        self.predicted_hit_tokens = counter(
            "pdpool_router_prefix_predicted_hit_tokens", "Prompt tokens the index said the chosen node holds.",
            ["role"])
        self.realized_hit_tokens = counter(
            "pdpool_router_prefix_realized_hit_tokens", "Prompt tokens the node served from its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens).", ["role"])
        self.affinity_yields = Counter("pdpool_router_affinity_yields", "Decisions where prefix affinity yielded "
                                       "to load (load-margin-filter).", registry=r)
        self.lease_releases = Counter("pdpool_router_lease_releases", "Prefill leases the router released at once "
                                      "(client gone, or the decode leg failed).", registry=r)
        self.inflight = None
        if local is None:
            self.inflight = Gauge("pdpool_router_inflight_requests", INFLIGHT_DOC, ["node"], registry=r,
                                  multiprocess_mode="livesum")
        self.hit_tokens = {role: tuple(c.labels(role) for c in (self.prompt_tokens, self.predicted_hit_tokens,
                                                                 self.realized_hit_tokens))
                           for role in ("prefill", "decode")}   # (prompt, predicted, realized) per leg role
        if inflight is not None and self.inflight is not None:
            inflight.gauge = self.inflight
            for node_id, n in inflight.requests.items():  # legs routed before the metrics existed
                self.inflight.labels(node_id).inc(n)
        self.pool = pool
        if self.multiprocess:  # a scrape reads every worker's files, plus this worker's view of the nodes
            from prometheus_client import multiprocess

            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry)
        if local is not None:
            self.registry.register(local)
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
        if self.pool is not None and self.inflight is not None:  # every known node has a series, 0 while idle
            for node_id in list(self.pool.endpoints):            # (touching a child keeps its value)
                self.inflight.labels(node_id)
        return generate_latest(self.registry)


INFLIGHT_DOC = "Legs in flight per node."


class _Count:
    """One series of a counter family, as prometheus_client's child: ``inc(amount)``."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class _CounterFamily:
    """A labelled counter kept in this process: ``labels(*values)`` returns its series (``_Count``)."""

    def __init__(self, name: str, doc: str, labelnames: list[str]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.children: dict[tuple, _Count] = {}

    def labels(self, *values) -> _Count:
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = _Count()
        return child

    def family(self, created: bool) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in list(self.children.items()):
            fam.add_metric(key, child.value, created=child.created if created else None)
        return fam


class _Histogram:
    """An unlabelled histogram kept in this process: ``observe(value)``, counted in the first bucket whose upper
    bound is at least ``value``, as prometheus_client's."""

    def __init__(self, name: str, doc: str, buckets) -> None:
        self.name, self.doc = name, doc
        self.bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def family(self, created: bool) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc)
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds, list(self.counts)):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        fam.add_metric([], buckets, self.sum)
        if created:
            fam.samples.append(Sample(self.name + "_created", {}, self.created))
        return fam


class _LocalCollector:
    """The per-request families of a single-process router, read at scrape time."""

    def __init__(self, inflight, pool) -> None:
        self.families: list = []
        self.tracker = inflight
        self.pool = pool

    def counter(self, name: str, doc: str, labelnames: list[str]) -> _CounterFamily:
        self.families.append(_CounterFamily(name, doc, labelnames))
        return self.families[-1]

    def histogram(self, name: str, doc: str, buckets) -> _Histogram:
        self.families.append(_Histogram(name, doc, buckets))
        return self.families[-1]

    def collect(self):
        created = _prometheus_metrics._use_created
        for f in self.families:
            yield f.family(created)
        if self.tracker is not None:  # every node ever given a leg or known now has a series, 0 while idle
            gauge = GaugeMetricFamily("pdpool_router_inflight_requests", INFLIGHT_DOC, labels=["node"])
            counts = self.tracker.requests
            nodes = list(counts) + [n for n in (list(self.pool.endpoints) if self.pool is not None else ())
                                    if n not in counts]
            for node_id in nodes:
                gauge.add_metric([node_id], float(counts.get(node_id, 0)))
            yield gauge


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
