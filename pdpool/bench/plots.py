"""PNG plots of one or more bench results on the same axes (matplotlib, the ``bench`` extra):
``latency_cdf.png`` (TTFT, TPOT, ITL, E2EL), ``ttft_over_time.png``, and for sweeps ``throughput_vs_rate.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdpool.bench.report import load_name, records_of


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed: the results stand, only their plots are missing."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("they need matplotlib: pip install 'pdpool[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(results: list[dict]):
    """(name, run) for every run of every result; the result's label is left out when there is one result."""
    for data in results:
        for run in data["runs"]:
            yield (load_name(run) if len(results) == 1 else f"{data['label']}: {load_name(run)}"), run


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdfs(plt, results, out_dir), _ttft_over_time(plt, results, out_dir)]
    if any(len([r for r in data["runs"] if r.get("rate") is not None]) > 1 for data in results):
        paths.append(_throughput_vs_rate(plt, results, out_dir))
    return paths


def _latency_cdfs(plt, results, out_dir: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    metrics = (("TTFT", lambda rs: [r.ttft for r in rs if r.ok and r.ttft is not None]),
               ("TPOT", lambda rs: [r.tpot for r in rs if r.tpot is not None]),
               ("ITL", lambda rs: [g for r in rs if r.ok for g in r.itl]),
               ("E2E latency", lambda rs: [r.latency for r in rs if r.ok]))
    for ax, (name, values_of) in zip(axes.flat, metrics):
        for label, run in _series(results):
            values = np.sort(np.asarray(values_of(records_of(run)), dtype=float)) * 1000.0
            if len(values):  # the empirical CDF: 0 up to the smallest value, 1 from the largest
                ax.step(np.concatenate([values[:1], values]), np.arange(len(values) + 1) / len(values),
                        where="post", label=label)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    return _save(plt, fig, out_dir / "latency_cdf.png")


def _ttft_over_time(plt, results, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, run in _series(results):
        points = [(r.send_time, r.ttft * 1000.0) for r in records_of(run) if r.ok and r.ttft is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, ".", alpha=0.7, label=label)
    ax.set_xlabel("request sent at (s after the run's start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(plt, fig, out_dir / "ttft_over_time.png")


def _throughput_vs_rate(plt, results, out_dir: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("request throughput (req/s)", "request_throughput"), ("output throughput (tok/s)", "output_throughput"),
              ("goodput (req/s)", "goodput"))
    for ax, (title, key) in zip(axes, panels):
        for data in results:
            runs = sorted((r for r in data["runs"] if r.get("rate") is not None), key=lambda r: r["rate"])
            points = [(r["rate"], r["summary"][key]) for r in runs if r["summary"].get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, "o-", label=data["label"])
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title if key != "goodput" else title + " (needs --slo)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(plt, fig, out_dir / "throughput_vs_rate.png")


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
