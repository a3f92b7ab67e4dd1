"""Prometheus metrics of one node, in a per-app registry (several servers may share a process).

Latency histograms are observed as outputs leave the engine loop. Gauges and counters are read from
``engine.stats()`` at scrape time, so they are never stale and never double-counted.

Each has a ``pdpool_*`` name and, where vLLM has the same measure, vLLM's name too, with vLLM's labels
(``model_name``: the served name; ``engine``: "0"), so what reads a vLLM server reads a node: the Gateway API
Inference Extension endpoint picker (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info``), and vLLM's Grafana dashboards and alerts (token counters, prefix-cache counters,
the TTFT, inter-token and end-to-end latency histograms). vLLM's histograms are the pdpool ones relabeled at
scrape time: one observation each, the same buckets.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], histograms: dict[str, Histogram], labels: dict[str, str]) -> None:
        self._stats = stats
        self._histograms = histograms   # vLLM's name -> the pdpool histogram it relabels
        self._labels = labels           # vLLM's labels: model_name, engine

    def collect(self):
        s = self._stats()
        gauges = {
            "pdpool_num_requests_running": ("Requests in the running batch.", s["num_running"]),
            "pdpool_num_requests_waiting": ("Requests waiting to be scheduled.", s["num_waiting"]),
            "pdpool_kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", s["kv_cache_usage"]),
            "pdpool_kv_cache_free_blocks": ("KV blocks free (including cached, evictable ones).",
                                            s["num_free_blocks"]),
            "pdpool_kv_cache_total_blocks": ("KV blocks allocated on this node.", s["num_total_blocks"]),
            "pdpool_prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / prompt tokens.",
                                             s["prefix_cache_hit_rate"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pdpool_prefill_chunks": ("Prefill chunks that stopped short of the prompt's end.",
                                      s["num_prefill_chunks"]),
            "pdpool_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.",
                                               s["prefix_cache_hit_tokens"]),
            "pdpool_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache.",
                                                   s["prefix_cache_queried_tokens"]),
            "pdpool_preemptions": ("Requests preempted (KV freed, recomputed later).", s["num_preemptions"]),
            "pdpool_prompt_tokens": ("Prompt tokens of requests admitted.", s["prompt_tokens"]),
            "pdpool_generation_tokens": ("Tokens generated.", s["generation_tokens"]),
            "pdpool_requests_finished": ("Requests finished, any reason.", s["num_finished"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from self._vllm(s)

    def _vllm(self, s: dict):
        names, values = list(self._labels), list(self._labels.values())
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", s["num_running"]),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage"])):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        for name, doc, value in (
                ("vllm:prompt_tokens", "Prompt tokens of requests admitted.", s["prompt_tokens"]),
                ("vllm:generation_tokens", "Tokens generated.", s["generation_tokens"]),
                ("vllm:num_preemptions", "Requests preempted.", s["num_preemptions"]),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s["prefix_cache_queried_tokens"]),
                ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                 s["prefix_cache_hit_tokens"])):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (GAIE name).",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(s["block_size"]), str(s["num_total_blocks"])], 1.0)
        yield info
        for name, histogram in self._histograms.items():
            (theirs,) = histogram.collect()
            family = Metric(name, theirs.documentation, "histogram")
            for sample in theirs.samples:
                family.add_sample(name + sample.name[len(theirs.name):], {**sample.labels, **self._labels},
                                  sample.value)
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], model_name: str = "") -> None:
        """``model_name``: the served name, vLLM's ``model_name`` label."""
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pdpool_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdpool_inter_token_latency_seconds", "Time between two output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdpool_e2e_request_latency_seconds", "Arrival to last output token.",
                             buckets=_LATENCY_BUCKETS + (160.0, 320.0), registry=self.registry)
        histograms = {"vllm:time_to_first_token_seconds": self.ttft, "vllm:inter_token_latency_seconds": self.itl,
                      "vllm:e2e_request_latency_seconds": self.e2e}
        self.registry.register(_EngineCollector(stats, histograms, {"model_name": model_name, "engine": "0"}))

    def render(self) -> bytes:
        return generate_latest(self.registry)
