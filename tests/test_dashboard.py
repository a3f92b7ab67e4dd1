"""The Grafana dashboard (charts/pdpool/files/grafana-dashboard.json) queries only what pdpool exports.

The exported names come from the real metrics objects: a pool node's (``Node`` of a prefill node: engine
gauges and counters, latency histograms, KV transfer metrics), the router's (``RouterMetrics`` over a pool with a
node and a request in flight) and the operator's (``Health``), rendered to the Prometheus text format and parsed
back. Every PromQL expression of every panel and template variable is then parsed: each metric name must be an
exported sample name (``_bucket``/``_sum``/``_count`` of histograms, ``_total`` of counters, as exported), each
label a matcher, ``by (...)`` or legend uses must be the metric's own or one Prometheus adds to every target
(including the chart's PodMonitor relabelings), and no target label may hide a metric's own label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "pdpool" / "files" / "grafana-dashboard.json"
PODMONITORS = ROOT / "charts" / "pdpool" / "templates" / "podmonitors.yaml"
# Labels Prometheus (Operator) puts on every scraped series of a PodMonitor target.
SCRAPE_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "service"}
FUNCTIONS = {"rate", "irate", "increase", "sum", "max", "min", "avg", "count", "histogram_quantile", "topk",
             "bottomk", "label_values", "clamp_min", "clamp_max", "abs", "delta", "deriv", "avg_over_time",
             "max_over_time", "min_over_time", "sum_over_time", "quantile", "vector", "scalar", "time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def exposition_of_node() -> str:
    from pdpool import config
    from pdpool.node import Node

    node = Node(config.build(model="demo", role="prefill"))  # a pool node: its KV transfer metrics too
    assert node.pooled
    return node.metrics.render().decode()


def exposition_of_router() -> str:
    from pdpool.router.endpoints import Endpoint, Pool
    from pdpool.router.inflight import InflightTracker
    from pdpool.router.metrics import RouterMetrics

    pool, inflight = Pool(), InflightTracker()
    pool.replace("static", [Endpoint("decode-0", "http://127.0.0.1:1", "decode")])
    inflight.add("decode-0", 16)
    metrics = RouterMetrics(pool, inflight)
    metrics.responses.labels("200").inc()                       # labelled families show up once used
    metrics.upstream_errors.labels("decode-0", "timeout").inc()
    metrics.set_index_mode("precise")
    return metrics.render().decode()


def exposition_of_operator() -> str:
    from pdpool.operator.health import Health

    return generate_latest(Health().registry).decode()


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, over the node, the router and the operator."""
    found: dict[str, set[str]] = {}
    for text in (exposition_of_node(), exposition_of_router(), exposition_of_operator()):
        for family in text_string_to_metric_families(text):
            assert family.samples, f"{family.name} exported no sample: its names are unknown"
            for sample in family.samples:
                found.setdefault(sample.name, set()).update(sample.labels)
    return found


@pytest.fixture(scope="module")
def target_labels() -> set[str]:
    """SCRAPE_LABELS plus the targetLabels of the chart's PodMonitor relabelings."""
    relabeled = set(re.findall(r"targetLabel:\s*([A-Za-z_][A-Za-z0-9_]*)", PODMONITORS.read_text()))
    return SCRAPE_LABELS | relabeled


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def expressions(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expr, legendFormat) of every panel target and query variable."""
    found = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels(dashboard) for t in p["targets"]]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            found.append((f"variable {v['name']}", query, ""))
    return found


_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*")  # not the "m" of 5m or the "e3" of 1e3


def parse_promql(expr: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(metric name -> labels its matchers use, grouping labels, functions), of one expression."""
    metrics: dict[str, set[str]] = {}
    if label_values_label(expr):  # a variable's label_values(selector, label): the label is checked by the caller
        expr = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", expr).group(1)
    text = re.sub(r"\[[^\]]*\]", " ", expr)                       # range selectors: [5m], [$__rate_interval]
    for name, body in _SELECTOR.findall(text):
        assert name, f"a selector without a metric name: {expr}"
        metrics.setdefault(name, set()).update(label for label, _, _ in _MATCHER.findall(body))
    text = _SELECTOR.sub(lambda m: f" {m.group(1)} ", text)
    grouping = {label.strip() for _, labels in _GROUPING.findall(text) for label in labels.split(",")
                if label.strip()}
    text = _GROUPING.sub(" ", text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", text)
    functions = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if re.match(r"\s*\(", text[m.end():]):
            functions.add(word)
        elif word not in KEYWORDS:
            metrics.setdefault(word, set())
    return metrics, grouping, functions


def label_values_label(expr: str) -> str | None:
    m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", expr)
    return m.group(2) if m else None


def test_every_metric_and_label_of_every_query_is_exported(dashboard, exported, target_labels):
    queries = expressions(dashboard)
    assert len(queries) > 20
    for where, expr, legend in queries:
        metrics, grouping, functions = parse_promql(expr)
        assert metrics, f"{where}: no metric in {expr!r}"
        assert functions <= FUNCTIONS, f"{where}: unknown functions {functions - FUNCTIONS} in {expr!r}"
        own = set()
        for name, labels in metrics.items():
            assert name in exported, f"{where}: {name} is not exported by the node, the router or the operator " \
                                     f"(did you mean one of {sorted(n for n in exported if n[:12] == name[:12])}?)"
            own |= exported[name]
            unknown = labels - exported[name] - target_labels
            assert not unknown, f"{where}: {name} has no label {sorted(unknown)}"
        extra = label_values_label(expr)
        grouping |= {extra} if extra else set()
        unknown = grouping - own - target_labels
        assert not unknown, f"{where}: grouping by labels no series has: {sorted(unknown)} in {expr!r}"
        if "by (" in expr:  # a legend names only labels the aggregated result keeps
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
            assert legend_labels <= grouping, f"{where}: legend {legend!r} uses labels the query drops"


def test_the_dashboard_has_the_panels_the_issue_asks_for(dashboard):
    by_title = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels(dashboard)}
    wanted = {
        "Time to first token": "pdpool_time_to_first_token_seconds_bucket",
        "Inter-token latency": "pdpool_inter_token_latency_seconds_bucket",
        "Throughput": "pdpool_generation_tokens_total",
        "Queue depth": "pdpool_num_requests_waiting",
        "KV cache usage": "pdpool_kv_cache_usage_perc",
        "Predicted vs realized prefix hits": "pdpool_router_prefix_realized_hit_tokens_total",
        "Route decisions": "pdpool_router_requests_total",
        "KV transfer bandwidth": "pdpool_kv_pulled_bytes_total",
        "Recomputes and transfer outcomes": "pdpool_kv_recomputes_total",
    }
    for title, metric in wanted.items():
        assert title in by_title, f"no panel {title!r}"
        assert metric in by_title[title], f"panel {title!r} does not query {metric}"
    assert "pdpool_router_prefix_predicted_hit_tokens_total" in by_title["Predicted vs realized prefix hits"]


def test_pool_and_namespace_filters_work_with_the_charts_podmonitor(dashboard, target_labels):
    """The panels filter on ``pool`` (the PodMonitor's relabeling of the pods' app.kubernetes.io/instance) and
    ``namespace``; the 'All' value matches series without the label too."""
    assert "pool" in target_labels
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in ("namespace", "pool"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for where, expr, _ in expressions(dashboard):
        if where.startswith("variable") or "pdpool_operator_" in expr:
            continue
        assert 'namespace=~"$namespace"' in expr and 'pool=~"$pool"' in expr, f"{where}: unfiltered {expr!r}"


def test_no_target_label_hides_a_metric_label(exported, target_labels):
    """Prometheus renames a scraped label that a target label also sets (to exported_<name>), so a PodMonitor
    relabeling to, say, ``role`` would break every query on the router's own ``role`` label."""
    clashes = {name: sorted(labels & (target_labels - SCRAPE_LABELS)) for name, labels in exported.items()
               if labels & (target_labels - SCRAPE_LABELS)}
    assert not clashes, f"PodMonitor target labels clash with exported labels: {clashes}"


def test_the_promql_parser_finds_what_it_must():
    metrics, grouping, functions = parse_promql(
        'sum by (pod, le) (rate(a_total{x="1", y=~"$v"}[$__rate_interval])) / on (pod) b + 2 * c_count offset 5m')
    assert metrics == {"a_total": {"x", "y"}, "b": set(), "c_count": set()}
    assert grouping == {"pod", "le"} and functions == {"sum", "rate"}
    assert label_values_label('label_values(m{namespace=~"$namespace"}, pool)') == "pool"
