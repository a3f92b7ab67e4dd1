"""The summary table, and the JSON of a bench result (config, runs with their records and summaries)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from pdpool.bench.stats import METRICS, RequestRecord

VERSION = 1
RESULT_FILE = "bench.json"


def result(label: str, config: dict, runs: list[dict], sweep: dict | None = None) -> dict:
    """``runs``: [{'rate', 'concurrency', 'summary', 'records': [RequestRecord]}]."""
    return {"version": VERSION, "label": label, "config": config, "sweep": sweep,
            "runs": [{**run, "records": [dataclasses.asdict(r) for r in run["records"]]} for run in runs]}


def write_result(data: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULT_FILE
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def read_result(path: Path) -> dict:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("version") != VERSION or "runs" not in data:
        raise ValueError(f"{path}: not a pdpool bench result (version {VERSION})")
    data.setdefault("label", Path(path).parent.name or Path(path).stem)
    return data


def records_of(run: dict) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in run["records"]]


def load_name(run: dict) -> str:
    parts = []
    if run.get("rate") is not None:
        parts.append(f"rate {run['rate']:g}/s")
    if run.get("concurrency"):
        parts.append(f"concurrency {run['concurrency']}")
    return ", ".join(parts) or "all at once"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(label: str, runs: list[dict], metrics=METRICS) -> str:
    """One block per run: counts, throughput, cache hits, goodput, then the latency distributions of ``metrics``
    (mean and the percentiles the summary holds)."""
    lines = []
    for run in runs:
        s = run["summary"]
        lines.append(f"==== {label}: {load_name(run)} ====")
        rows = [
            ("completed / failed", f"{s['completed']} / {s['failed']}"),
        ]
        if s.get("not_sent"):
            rows.append(("not sent (time limit)", str(s["not_sent"])))
        rows += [
            ("duration (s)", f"{s['duration_s']:.2f}"),
            ("input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"
             + ("" if s["usage_reported"] else " (local estimate: no usage from the server)")),
            ("request throughput (req/s)", f"{s['request_throughput']:.3f}"),
            ("output throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
            ("prefix-cache hit ratio", f"{s['prefix_cache_hit_ratio']:.3f}"),
        ]
        if s.get("slo"):
            slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo"].items())
            rows.append((f"goodput (req/s, {slo})", f"{s['goodput']:.3f}"))
            rows.append(("SLO attainment", f"{s['slo_attainment']:.3f}"))
        width = max(len(name) for name, _ in rows)
        lines += [f"{name:<{width}}  {value}" for name, value in rows]
        columns = list(s["ttft_ms"])  # mean, then the percentiles
        lines.append(f"{'(ms)':<6}" + "".join(f"{c:>10}" for c in columns))
        for metric in metrics:
            d = s[f"{metric}_ms"]
            lines.append(f"{metric.upper():<6}" + "".join(f"{_ms(d.get(c)):>10}" for c in columns))
    return "\n".join(lines)


def failures(runs: list[dict], time_limit: float, most: int = 3) -> list[str]:
    """The commonest errors of each run's failed requests, one line each (``N of M requests failed: error``), and
    the requests the time limit left unsent (``N of M requests not sent``)."""
    lines = []
    for run in runs:
        records = run["records"]
        where = "" if len(runs) == 1 else f"{load_name(run)}: "
        errors = Counter((r["error"] if isinstance(r, dict) else r.error) for r in records)
        errors.pop(None, None)
        for error, n in errors.most_common(most):
            lines.append(f"{where}{n} of {len(records)} requests failed: {error.splitlines()[0][:300]}")
        not_sent = run["summary"].get("not_sent")
        if not_sent:
            lines.append(f"{where}{not_sent} of {len(records) + not_sent} requests not sent: the time limit "
                         f"({time_limit:g} s) came first")
    return lines
