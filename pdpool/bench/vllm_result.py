"""``--save-result``: one run as the JSON file of ``vllm bench serve --save-result``, with its keys and meanings
(flat ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ... for ``--percentile-metrics`` at
``--metric-percentiles``; per-request ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``errors``), so that
scripts written for vLLM's results read pdpool's."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from pdpool.bench.stats import METRICS, RequestRecord, metric_values, percentile_key

DEFAULT_METRICS = ("ttft", "tpot", "itl")  # vLLM's defaults
DEFAULT_PERCENTILES = (99.0,)


def parse_metrics(text: str) -> tuple[str, ...]:
    """``"ttft,e2el"`` -> ('ttft', 'e2el'); ``ValueError`` names the one that is not a metric."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if name not in METRICS:
            raise ValueError(f"{name!r} is not one of {', '.join(METRICS)}")
    if not names:
        raise ValueError("no metric named")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"25,50,99.9"`` -> (25.0, 50.0, 99.9), each in [0, 100]."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"{text!r}: each percentile must be in [0, 100]")
    return values


def result(run: dict, *, backend: str, label: str, model: str, tokenizer: str | None, burstiness: float,
           metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> dict:
    """``run``: {'rate', 'concurrency', 'summary', 'records': [RequestRecord]} as ``main`` makes it. A metric
    without any value reads 0, as in vLLM."""
    records: list[RequestRecord] = run["records"]
    s = run["summary"]
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer or model,
        "num_prompts": len(records) + s["not_sent"],
        "request_rate": "inf" if run["rate"] is None else run["rate"],
        "burstiness": burstiness,
        "max_concurrency": run["concurrency"],
        "duration": s["duration_s"],
        "completed": s["completed"],
        "failed": s["failed"],
        "total_input_tokens": s["total_input_tokens"],
        "total_output_tokens": s["total_output_tokens"],
        "request_throughput": s["request_throughput"],
        "request_goodput": s["goodput"],
        "output_throughput": s["output_throughput"],
        "total_token_throughput": s["total_token_throughput"],
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.completion_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [r.itl for r in records],
        "errors": [r.error or "" for r in records],
    }
    values = metric_values(records)
    for name in metrics:
        ms = np.asarray(values[name] or [0.0], dtype=float) * 1000.0
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def file_name(data: dict) -> str:
    """vLLM's default: ``{label}-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json``."""
    concurrency = f"-concurrency{data['max_concurrency']}" if data["max_concurrency"] else ""
    model = data["model_id"].rstrip("/").split("/")[-1]
    return f"{data['label']}-{data['request_rate']}qps{concurrency}-{model}-{data['date']}.json"


def write(data: dict, result_dir: Path, name: str | None = None) -> Path:
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / (name or file_name(data))
    path.write_text(json.dumps(data) + "\n", encoding="utf-8")
    return path

