"""``pdpool bench``: the statistics on hand-made records with known answers, the datasets and the load shape, and
the command itself against a real node on both endpoints (JSON, PNGs, token counts against the node's own
counters), plus ``pdpool bench compare``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpool.bench import datasets, load, report, stats
from pdpool.bench.stats import RequestRecord

ROOT = Path(__file__).resolve().parents[1]


def make_record(i=0, ttft=0.1, latency=1.0, completion_tokens=10, itl=(), prompt_tokens=20, cached=0,
                error=None, send_time=0.0) -> RequestRecord:
    return RequestRecord(index=i, send_time=send_time, prompt_tokens=prompt_tokens, max_tokens=completion_tokens,
                         completion_tokens=completion_tokens, cached_tokens=cached, usage_reported=True, ttft=ttft,
                         latency=None if error else latency, itl=list(itl), error=error)


# ---- statistics ----------------------------------------------------------------------------------

def test_distribution_is_in_ms_with_linear_percentiles():
    d = stats.distribution([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert stats.distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token_and_is_undefined_for_one_token():
    assert make_record(ttft=0.2, latency=1.1, completion_tokens=10).tpot == pytest.approx(0.1)
    assert make_record(ttft=0.2, latency=0.2, completion_tokens=1).tpot is None
    assert make_record(error="HTTP 500").tpot is None


def test_summary_of_known_records():
    records = [
        make_record(0, ttft=0.1, latency=0.5, completion_tokens=5, itl=[0.1, 0.1, 0.1, 0.1], prompt_tokens=40,
                    cached=16),
        make_record(1, ttft=0.3, latency=1.5, completion_tokens=4, itl=[0.4, 0.4, 0.4], prompt_tokens=60, cached=0),
        make_record(2, error="HTTP 503: busy"),
    ]
    s = stats.summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"], s["cached_tokens"]) == (100, 9, 16)
    assert s["prefix_cache_hit_ratio"] == pytest.approx(0.16)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(54.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 400.0) / 2)   # (0.5-0.1)/4 and (1.5-0.3)/3
    assert s["itl_ms"]["mean"] == pytest.approx((4 * 100 + 3 * 400) / 7)  # every gap pooled, not per request
    assert s["e2el_ms"]["p50"] == pytest.approx(1000.0)
    assert s["goodput"] is None and s["slo_attainment"] is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        make_record(0, ttft=0.1, latency=1.0, completion_tokens=10),   # tpot 100 ms
        make_record(1, ttft=0.6, latency=1.5, completion_tokens=10),   # ttft over
        make_record(2, ttft=0.1, latency=2.8, completion_tokens=10),   # tpot 300 ms: over
        make_record(3, ttft=0.2, latency=0.2, completion_tokens=1),    # no tpot: meets the tpot SLO
        make_record(4, error="boom"),                                   # failed: never good
    ]
    slo = stats.parse_slo("ttft=500, tpot=150")
    assert slo == {"ttft": 500.0, "tpot": 150.0}
    s = stats.summarize(records, duration_s=4.0, slo=slo)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert stats.summarize(records, 4.0, {"e2el": 1000.0})["goodput"] == pytest.approx(2 / 4.0)


@pytest.mark.parametrize("bad", ["ttft", "speed=3", "ttft=0", "tpot=-1"])
def test_bad_slo_is_refused(bad):
    with pytest.raises(ValueError):
        stats.parse_slo(bad)


def test_distserve_goodput_of_a_sweep_is_the_highest_rate_meeting_the_attainment():
    runs = [{"rate": r, "summary": {"slo_attainment": a}} for r, a in ((1, 1.0), (2, 0.95), (4, 0.92), (8, 0.5))]
    assert stats.max_rate_meeting_attainment(runs, 0.9) == 4
    assert stats.max_rate_meeting_attainment(runs, 0.99) == 1
    assert stats.max_rate_meeting_attainment(runs[3:], 0.9) is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=50))
def test_percentiles_are_ordered_and_bounded(values):
    d = stats.distribution(values)
    low, high = min(values) * 1000, max(values) * 1000
    assert low - 1e-6 <= d["p50"] <= d["p90"] + 1e-9 <= d["p99"] + 2e-9 <= high + 1e-6
    assert low - 1e-6 <= d["mean"] <= high + 1e-6


# ---- datasets and load ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    from pdpool.frontend import Frontend

    return Frontend.from_model("demo")


def test_random_lengths_are_in_range_and_exact_for_token_ids(frontend):
    lengths = datasets.Lengths(frontend)
    reqs = datasets.random_requests(20, (5, 9), (2, 3), lengths, seed=1, token_ids=True)
    assert all(5 <= len(r.prompt) == r.prompt_len <= 9 and 2 <= r.max_tokens <= 3 for r in reqs)
    texts = datasets.random_requests(10, (30, 30), (4, 4), lengths, seed=1)
    # text of n tokens re-encodes to about n tokens (decode/encode may merge at most a few)
    assert all(abs(lengths.count(r.prompt) - 30) <= 2 for r in texts)
    assert datasets.random_requests(3, (7, 7), (1, 1), datasets.Lengths(), seed=2)[0].prompt.count(" ") == 6
    assert [r.prompt for r in reqs] == [r.prompt for r in datasets.random_requests(20, (5, 9), (2, 3), lengths, 1,
                                                                                   token_ids=True)]


def test_shared_prefix_groups_share_their_system_prompt(frontend):
    lengths = datasets.Lengths(frontend)
    reqs = datasets.shared_prefix_requests(3, 4, 40, 8, 5, lengths, seed=0)
    assert len(reqs) == 12 and sorted(r.group for r in reqs) == sorted([0, 1, 2] * 4)
    systems = {}
    for r in reqs:
        system, _, question = r.prompt.partition("\n")
        systems.setdefault(r.group, set()).add(system)
        assert abs(lengths.count(system) - 40) <= 2 and r.max_tokens == 5
    assert all(len(s) == 1 for s in systems.values()) and len({next(iter(s)) for s in systems.values()}) == 3
    chat = datasets.shared_prefix_requests(2, 2, 10, 4, 3, datasets.Lengths(), seed=0, chat=True)
    assert [m["role"] for m in chat[0].messages] == ["system", "user"]


def test_jsonl_prompts_and_messages(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n{"messages": [{"role": "user", "content": "hi there"}], '
                    '"max_tokens": 7}\n{"prompt": [1, 2, 3, 4]}\n')
    reqs = datasets.jsonl_requests(path, 5, datasets.Lengths())
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [(3, 5), (2, 7), (4, 5)]
    assert len(datasets.take(reqs, 7)) == 7
    path.write_text('{"prompt": "x", "messages": []}\n')
    with pytest.raises(ValueError, match="exactly one"):
        datasets.jsonl_requests(path, 5, datasets.Lengths())


def test_poisson_arrivals_have_the_rate():
    times = load.arrival_times(4000, 20.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.08)
    assert load.arrival_times(3, None, 0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    """vLLM's --burstiness: gamma gaps of shape b and mean 1/rate, so their coefficient of variation is 1/sqrt(b)
    (b = 1: Poisson, the same arrivals as without it)."""
    gaps = np.diff(load.arrival_times(20000, 10.0, seed=1, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.1)
    assert load.arrival_times(50, 10.0, seed=1) == load.arrival_times(50, 10.0, seed=1, burstiness=1.0)


def _timed_send(seconds: float, in_flight: list[int]):
    async def send(i: int, send_time: float) -> RequestRecord:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(seconds)
        finally:
            in_flight[0] -= 1
        return make_record(i, ttft=seconds, latency=seconds, send_time=send_time)

    return send


def _blank(i: int, send_time: float) -> RequestRecord:
    return RequestRecord(index=i, send_time=send_time, prompt_tokens=1, max_tokens=1)


def test_concurrency_caps_the_requests_in_flight():
    in_flight = [0, 0]
    records, duration = asyncio.run(load.run_load(8, _timed_send(0.05, in_flight), _blank, rate=None,
                                                  concurrency=3, time_limit=30, progress=False))
    assert [r.index for r in records] == list(range(8)) and all(r.ok for r in records)
    assert in_flight[1] == 3
    assert 0.05 * 3 <= duration < 5


def test_the_time_limit_cuts_the_run():
    in_flight = [0, 0]
    t0 = time.perf_counter()
    records, duration = asyncio.run(load.run_load(50, _timed_send(30.0, in_flight), _blank, rate=None,
                                                  concurrency=4, time_limit=0.3, progress=False))
    assert time.perf_counter() - t0 < 5 and 0.3 <= duration < 5
    assert len(records) == 4 and all(r.error == load.TIME_LIMIT_ERROR for r in records)  # the rest never sent
    assert stats.summarize(records, duration)["completed"] == 0


# ---- the command against a real node -------------------------------------------------------------

def _bench(*args: str, timeout: float = 240, returncode: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == returncode, proc.stdout + proc.stderr
    return proc


def _token_counters(server) -> dict[str, float]:
    m = server.metrics()
    return {k: m[f"pdpool_{k}_total"] for k in ("prompt_tokens", "generation_tokens", "prefix_cache_hit_tokens")}


@pytest.fixture(scope="module")
def node(launch_server):
    server = launch_server("--max-num-seqs", "4", "--num-kv-blocks", "256")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def completions_run(node, frontend, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "completions"
    before = _token_counters(node)
    proc = _bench("--url", node.url, "--model", "demo", "--endpoint", "completions", "--dataset", "random",
                  "--random-token-ids", "--random-input-len", "8:24", "--random-output-len", "3:6",
                  "--num-requests", "6", "--concurrency", "3", "--ignore-eos", "--seed", "5", "--time-limit", "120",
                  "--slo", "ttft=60000,tpot=60000", "--out", str(out), "--no-progress")
    return out, proc, before, _token_counters(node)


def test_completions_run_writes_json_and_plots_with_exact_counts(completions_run, frontend):
    out, proc, before, after = completions_run
    assert "TTFT" in proc.stdout and "request throughput" in proc.stdout
    assert {p.name for p in out.iterdir()} >= {"bench.json", "latency_cdf.png", "ttft_over_time.png"}
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in ("latency_cdf.png",
                                                                                  "ttft_over_time.png"))
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["num_requests"] == 6 and data["config"]["length_unit"] == "tokens"
    (run,) = data["runs"]
    records, summary = run["records"], run["summary"]
    assert len(records) == 6 and [r["index"] for r in records] == list(range(6))
    assert all(r["error"] is None and r["usage_reported"] for r in records)
    expected = datasets.random_requests(6, (8, 24), (3, 6), datasets.Lengths(frontend), seed=5, token_ids=True)
    for record, req in zip(records, expected):
        assert record["prompt_tokens"] == len(req.prompt)            # the server's usage for these very prompts
        assert record["completion_tokens"] == req.max_tokens == record["max_tokens"]  # ignore_eos
        assert len(record["itl"]) <= record["completion_tokens"] - 1
        assert 0 < record["ttft"] <= record["latency"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_input_tokens"] == sum(len(r.prompt) for r in expected)
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in expected)
    # the node's own counters moved by exactly what the bench reports
    assert after["prompt_tokens"] - before["prompt_tokens"] == summary["total_input_tokens"]
    assert after["generation_tokens"] - before["generation_tokens"] == summary["total_output_tokens"]
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == summary["cached_tokens"]
    assert summary["goodput"] == pytest.approx(6 / summary["duration_s"]) and summary["slo_attainment"] == 1.0
    assert summary["request_throughput"] == pytest.approx(6 / summary["duration_s"])


@pytest.fixture(scope="module")
def chat_sweep_run(node, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "chat-sweep"
    before = _token_counters(node)
    proc = _bench("--url", node.url + "/v1", "--model", "demo", "--endpoint", "chat", "--dataset", "shared-prefix",
                  "--num-groups", "2", "--prompts-per-group", "2", "--system-prompt-len", "56", "--question-len", "6",
                  "--output-len", "4", "--sweep", "4,8", "--concurrency", "1", "--ignore-eos", "--time-limit", "120",
                  "--slo", "ttft=60000", "--out", str(out), "--label", "chat sweep", "--no-progress")
    return out, proc, before, _token_counters(node)


def test_chat_sweep_on_shared_prefix(chat_sweep_run):
    out, proc, before, after = chat_sweep_run
    assert {p.name for p in out.iterdir()} >= {"bench.json", "latency_cdf.png", "ttft_over_time.png",
                                               "throughput_vs_rate.png"}
    data = json.loads((out / "bench.json").read_text())
    assert [run["rate"] for run in data["runs"]] == [4.0, 8.0]
    assert data["sweep"]["max_rate_meeting_slo"] == 8.0
    for run in data["runs"]:
        s = run["summary"]
        assert s["completed"] == 4 and len(run["records"]) == 4
        assert all(r["completion_tokens"] == 4 for r in run["records"])
        assert s["total_output_tokens"] == 16
    totals = {k: sum(run["summary"][key] for run in data["runs"]) for k, key in
              (("prompt_tokens", "total_input_tokens"), ("generation_tokens", "total_output_tokens"),
               ("prefix_cache_hit_tokens", "cached_tokens"))}
    assert {k: after[k] - before[k] for k in totals} == totals
    # one request at a time: the second user of each 56-token system prompt finds 3 full blocks cached
    for run in data["runs"]:
        assert run["summary"]["cached_tokens"] >= 2 * 3 * 16
        assert run["summary"]["prefix_cache_hit_ratio"] == pytest.approx(
            run["summary"]["cached_tokens"] / run["summary"]["total_input_tokens"])


def test_compare_draws_runs_on_the_same_axes(completions_run, chat_sweep_run, tmp_path):
    proc = _bench("compare", str(completions_run[0] / "bench.json"), str(chat_sweep_run[0]), "--out", str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {"latency_cdf.png", "ttft_over_time.png",
                                                    "throughput_vs_rate.png"}
    assert "completions" in proc.stdout and "chat sweep" in proc.stdout


def test_report_refuses_a_foreign_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"runs": []}')
    with pytest.raises(ValueError, match="not a pdpool bench result"):
        report.read_result(path)


def test_refused_requests_are_failures_not_latencies(node, tmp_path):
    # prompts longer than the demo model's context: the node answers 400 before streaming
    proc = _bench("--url", node.url, "--model", "demo", "--random-token-ids", "--random-input-len", "9000",
                  "--random-output-len", "2", "--num-requests", "2", "--out", str(tmp_path), "--no-progress",
                  returncode=1)
    (run,) = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert run["summary"]["completed"] == 0 and run["summary"]["failed"] == 2
    assert all(r["error"].startswith("HTTP 400") and r["latency"] is None for r in run["records"])
    assert "0 / 2" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--endpoint", "chat", "--random-token-ids"], "token-id prompts need the completions endpoint"),
    (["--slo", "ttft"], "--slo"),
    (["--slo", "ttft=x"], "--slo: 'ttft=x' is not NAME=MS"),  # was 'could not convert string to float: 'x''
    (["--goodput", "ttft:x"], "--slo: 'ttft=x' is not NAME=MS"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--dataset", "jsonl"], "--dataset-path"),
    # each of these raised a traceback (after sending, for --out) or ran something other than asked (0 requests
    # ran 100, concurrency 0 ran unbounded)
    (["--concurrency", "0"], "argument --concurrency/--max-concurrency: '0' must be > 0"),
    (["--concurrency", "-1"], "argument --concurrency/--max-concurrency: '-1' must be > 0"),
    (["--rate", "0"], "argument --rate/--request-rate: '0' must be > 0"),
    (["--num-requests", "0"], "argument --num-requests/--num-prompts: '0' must be > 0"),
    (["--time-limit", "0"], "argument --time-limit: '0' must be > 0"),
    (["--request-timeout", "-5"], "argument --request-timeout: '-5' must be > 0"),
    # these named no flag ("invalid literal for int() with base 10: 'abc'")
    (["--random-input-len", "abc"], "argument --random-input-len: 'abc' is not N or MIN:MAX with 1 <= MIN <= MAX"),
    (["--random-output-len", "8:4"], "argument --random-output-len: '8:4' is not N or MIN:MAX"),
    (["--random-input-len", "0"], "argument --random-input-len: '0' is not N or MIN:MAX"),
    (["--sweep", "1,0"], "--sweep: rate 0 must be > 0"),
    (["--sweep", "1,x"], "--sweep: 'x' is not a rate"),
    (["--sweep", ","], "--sweep ',' names no rate"),  # ran nothing, wrote an empty result and exited 0
    (["--sweep", ""], "--sweep '' names no rate"),
    (["--slo-attainment", "2"], "--slo-attainment 2 must be in (0, 1]"),
    (["--out", "/proc/no-such-folder"], "No such file or directory: '/proc/no-such-folder'"),
    (["--url", "127.0.0.1:9"], "--url '127.0.0.1:9' must start with http:// or https://"),
])
def test_bad_arguments_are_refused_before_sending(flags, message):
    proc = subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", "--url", "http://127.0.0.1:9", "--model",
                           "demo", "--num-requests", "1", "--no-progress", *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""  # refused before any run: no table


def test_why_requests_failed_is_said_without_out(node):
    """The table only counts failures; the error itself was only in bench.json, so a run without --out against a
    wrong model said nothing of why. (A server down at the start: tests/test_bench_faults.py.)"""
    proc = subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", "--url", node.url, "--model", "no-such-model",
                           "--num-requests", "2", "--tokenizer", "none", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "0 / 2" in proc.stdout
    assert "pdpool bench: 2 of 2 requests failed: HTTP 404: " in proc.stderr and "no-such-model" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("flags", [["--num-requests", "2"], ["--num-requests", "4", "--concurrency", "1"]])
def test_ctrl_c_stops_a_run_without_a_traceback(flags):
    """Ctrl-C (SIGINT) during a run printed asyncio's CancelledError and KeyboardInterrupt tracebacks; with
    --concurrency, the requests still waiting for a slot went on after the session closed, and each printed a
    'Task exception was never retrieved ... RuntimeError: Session is closed' traceback."""
    import signal
    import socket

    with socket.socket() as silent:  # accepts and never answers: the requests hang until the Ctrl-C
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        proc = subprocess.Popen([sys.executable, "-m", "pdpool.cli", "bench", "--url",
                                 f"http://127.0.0.1:{silent.getsockname()[1]}", "--model", "demo", *flags,
                                 "--tokenizer", "none", "--no-progress"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(3)  # past the imports: inside the run
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "pdpool bench: interrupted\n", err
