"""Per-request records and the run's summary, with the definitions of vLLM's serving benchmark.

Times are taken on the client, from sending the request:

- TTFT: to the first chunk that carries generated text;
- ITL: between consecutive chunks that carry text (every gap of every request, pooled);
- TPOT: ``(e2e - ttft) / (completion_tokens - 1)`` per request; undefined for one output token;
- E2EL: to the end of the response.

Token counts are the server's ``usage`` (``stream_options.include_usage``); the prefix-cache hit ratio is
``sum(prompt_tokens_details.cached_tokens) / sum(prompt_tokens)``. Goodput (DistServe, vLLM's ``--goodput``) counts
the completed requests that meet every SLO given, per second; a request with one output token has no TPOT and
meets a TPOT SLO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")  # the keys of metric_values, in the table's order
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    index: int
    send_time: float                  # seconds after the run started
    prompt_tokens: int                # the server's usage, else the local count
    max_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False      # False: the counts are local estimates
    ttft: float | None = None         # seconds
    latency: float | None = None      # end-to-end, seconds
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def percentile_key(p: float) -> str:
    """``p50``, ``p99``, ``p99.9``: vLLM's names."""
    return f"p{int(p)}" if p == int(p) else f"p{p}"


def distribution(values_s: list[float], percentiles=PERCENTILES) -> dict:
    """mean and ``percentiles`` (default p50, p90, p99) of ``values_s`` (seconds) in milliseconds; None for each when
    there is no value."""
    if not values_s:
        return {"mean": None, **{percentile_key(p): None for p in percentiles}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), **{percentile_key(p): float(np.percentile(ms, p)) for p in percentiles}}


def metric_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The completed requests' TTFT, TPOT, E2EL (one each where defined) and ITL (every gap), in seconds."""
    done = [r for r in records if r.ok]
    return {"ttft": [r.ttft for r in done if r.ttft is not None],
            "tpot": [r.tpot for r in done if r.tpot is not None],
            "itl": [gap for r in done for gap in r.itl],
            "e2el": [r.latency for r in done]}


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=200,tpot=50"`` -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            if not sep or name not in SLO_METRICS:
                raise ValueError
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r} is not NAME=MS with NAME one of {', '.join(SLO_METRICS)}") from None
        if not slo[name] > 0:
            raise ValueError(f"--slo: {name} must be > 0 ms")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    for name, limit_ms in slo.items():
        value = values[name]
        if value is None and name == "tpot":
            continue  # one output token: no decode phase to bound
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None,
              num_requests: int | None = None, percentiles=PERCENTILES) -> dict:
    """``num_requests``: the requests the run was to send; those without a record (the time limit came first) are
    ``not_sent``. ``percentiles``: those of each latency distribution."""
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "not_sent": max(0, (num_requests or 0) - len(records)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": cached,
        "usage_reported": all(r.usage_reported for r in done),
        "prefix_cache_hit_ratio": cached / input_tokens if input_tokens else 0.0,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        **{f"{name}_ms": distribution(values, percentiles) for name, values in metric_values(records).items()},
        "slo": slo or None,
        "goodput": None,
        "slo_attainment": None,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(records) if records else 0.0
    return summary


def max_rate_meeting_attainment(runs: list[dict], target: float) -> float | None:
    """DistServe's goodput of a sweep: the highest offered rate whose SLO attainment is at least ``target``."""
    rates = [run["rate"] for run in runs
             if run.get("rate") is not None and (run["summary"].get("slo_attainment") or 0.0) >= target]
    return max(rates) if rates else None
