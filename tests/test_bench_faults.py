"""``pdpool bench`` against a server that misbehaves: a tiny aiohttp server in a thread whose first path segment
picks the fault (``http://host:port/<fault>/v1/completions``), and whose ``replay`` fault streams back the chunks
that the request body names, so that any stream shape can be tried."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import scaled

from pdpool.bench import client, datasets
from pdpool.bench.datasets import BenchRequest
from pdpool.bench.stats import RequestRecord
from pdpool.node_process import free_port

ROOT = Path(__file__).resolve().parents[1]


async def _stream(request: web.Request, payloads: list[bytes], done: bool = True) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for payload in payloads:
        await resp.write(b"data: " + payload + b"\n\n")
    if done:
        await resp.write(b"data: [DONE]\n\n")
    return resp


def _text_chunks(n: int) -> list[bytes]:
    return [json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}).encode() for i in range(n)]


async def _handle(request: web.Request) -> web.StreamResponse:
    fault = request.match_info.get("fault", "ok")
    body = await request.json()
    if fault == "replay":  # the chunks the client asked for, verbatim, then [DONE] unless told not to
        return await _stream(request, [c.encode() for c in body["chunks"]], done=body.get("done", True))
    if fault == "ok" and request.path.endswith("/chat/completions"):
        return await _stream(request, [json.dumps({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}).encode()
                                       for i in range(3)])
    if fault == "ok":
        return await _stream(request, _text_chunks(3))
    if fault == "html":  # a web server that answers 200 to anything
        return web.Response(text="<html><body>hello</body></html>", content_type="text/html")
    if fault == "not-streamed":  # a server that ignores stream: true
        return web.json_response({"choices": [{"index": 0, "text": "hi"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    if fault == "cut":  # the stream ends cleanly after some text, with no [DONE]
        return await _stream(request, _text_chunks(2), done=False)
    if fault == "empty":  # an event stream that ends before its first event
        return await _stream(request, [], done=False)
    if fault == "bad-gateway":  # an error page that is not UTF-8
        return web.Response(status=502, body=b"\xff\xfe gateway down", content_type="text/plain")
    if fault == "partial-usage":  # usage without completion_tokens: the text is counted
        return await _stream(request, _text_chunks(2) + [b'{"choices": [], "usage": {"prompt_tokens": 7}}'])
    if fault == "slow":
        await asyncio.sleep(1.0)
        return await _stream(request, _text_chunks(1))
    raise web.HTTPNotFound()


@pytest.fixture(scope="module")
def fault_server():
    """The base URL of the fault server (``{url}/<fault>`` is a --url for pdpool bench)."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/{fault}/v1/completions", _handle)
    app.router.add_post("/{fault}/v1/chat/completions", _handle)
    app.router.add_post("/v1/completions", _handle)  # no fault: ok
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _send(url: str, extra: dict | None = None) -> RequestRecord:
    body = client.request_body(BenchRequest("hello", None, 1, 4), "completions", "m", extra or {})

    async def go() -> RequestRecord:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await client.send(session, client.endpoint_url(url, "completions"), body,
                                     RequestRecord(index=0, send_time=0.0, prompt_tokens=1, max_tokens=4))

    return asyncio.run(go())


def test_a_complete_stream_is_a_success(fault_server):
    record = _send(f"{fault_server}/ok")
    assert record.ok and record.completion_tokens == 3 and len(record.itl) == 2


@pytest.mark.parametrize("fault, error", [
    ("html", "no event stream in the response (Content-Type text/html)"),
    ("not-streamed", "no event stream in the response (Content-Type application/json)"),
    ("cut", "the stream ended before data: [DONE]"),
    ("empty", "the stream ended before data: [DONE]"),
])
def test_a_response_that_is_not_a_whole_event_stream_is_a_failure(fault_server, fault, error):
    """A 200 that is no stream, or a stream cut before [DONE], counted as a completed request (with 0 tokens, or
    the tokens before the cut), so a wrong URL or a server dying mid-stream gave a run of 'successes'."""
    record = _send(f"{fault_server}/{fault}")
    assert not record.ok and record.error == error


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=8)
_keys = st.sampled_from(["choices", "usage", "error", "delta", "text", "content", "prompt_tokens",
                         "completion_tokens", "prompt_tokens_details", "cached_tokens", "reasoning_content"])
# chunks shaped like OpenAI's, with any value in any place: the keys the client reads, nested
_chunk = st.recursive(_json, lambda inner: st.dictionaries(_keys, inner, max_size=3)
                      | st.lists(st.dictionaries(_keys, inner, max_size=3), max_size=2), max_leaves=12)


@settings(max_examples=scaled(150), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_chunk.map(json.dumps) | st.sampled_from(["{", "not json", "\u00e9"]), max_size=4), st.booleans())
def test_any_stream_gives_a_record_never_an_exception(fault_server, chunks, done):
    """A chunk that was JSON but not OpenAI-shaped ('data: [1, 2]', a string delta, usage with null counts)
    raised out of client.send, and the whole run ended in a traceback with every result lost."""
    record = _send(f"{fault_server}/replay", {"chunks": chunks, "done": done})
    assert record.ok or isinstance(record.error, str)
    if record.ok:
        assert isinstance(record.completion_tokens, int) and record.completion_tokens >= 0
        assert isinstance(record.prompt_tokens, int) and isinstance(record.cached_tokens, int)


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", "--model", "m", "--tokenizer", "none",
                           "--no-progress", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_requests_the_time_limit_left_unsent_are_reported(fault_server, tmp_path):
    """At the time limit the requests not yet sent were left out of every count: 6 asked, 1 completed and 1 cut
    read '1 / 1' and '1 of 2 requests failed', as if the run had been of 2 requests."""
    proc = _bench("--url", f"{fault_server}/slow", "--num-requests", "6", "--concurrency", "1", "--time-limit", "1.5",
                  "--out", str(tmp_path), "--random-input-len", "4", "--random-output-len", "1")
    summary = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"], summary["not_sent"]) == (1, 1, 4)
    assert re.search(r"\nnot sent \(time limit\) +4\n", proc.stdout), proc.stdout
    assert "pdpool bench: 4 of 6 requests not sent: the time limit (1.5 s) came first" in proc.stderr, proc.stderr


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_inf_means_no_bound_as_in_vllm(fault_server, tmp_path):
    """vLLM's --request-rate inf sends everything at once; here --request-timeout inf raised an OverflowError
    traceback, and --rate inf or --time-limit inf wrote Infinity into bench.json, which no strict JSON reader takes."""
    proc = _bench("--url", f"{fault_server}/ok", "--num-requests", "3", "--rate", "inf", "--time-limit", "inf",
                  "--request-timeout", "inf", "--random-input-len", "4", "--out", str(tmp_path / "rate"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    data = _strict_json((tmp_path / "rate" / "bench.json").read_text())
    assert data["runs"][0]["rate"] is None and data["runs"][0]["summary"]["completed"] == 3  # inf: all at once
    assert (data["config"]["rate"], data["config"]["time_limit"], data["config"]["request_timeout"]) == (None,) * 3
    proc = _bench("--url", f"{fault_server}/ok", "--num-requests", "3", "--sweep", "2,inf", "--random-input-len", "4",
                  "--out", str(tmp_path / "sweep"))
    assert proc.returncode == 0, proc.stderr
    data = _strict_json((tmp_path / "sweep" / "bench.json").read_text())
    assert [run["rate"] for run in data["runs"]] == [2.0, None]


def test_a_server_down_at_the_start_ends_the_run_at_once():
    """Nothing listening: every request failed on its own schedule, so --rate 0.5 with 20 requests took 40 s to say
    '20 of 20 requests failed' (a long run against a mistyped port took its whole length)."""
    port = free_port()
    t0 = time.monotonic()
    proc = _bench("--url", f"http://127.0.0.1:{port}", "--num-requests", "20", "--rate", "0.5")
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"pdpool bench: cannot connect to http://127.0.0.1:{port}: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_vllm_bench_serve_flags_mean_the_same(fault_server, tmp_path):
    """A vllm bench serve command line ran nothing: --base-url, --num-prompts, --request-rate, --max-concurrency,
    --backend, --endpoint /v1/chat/completions, --dataset-name, --random-range-ratio, --burstiness and
    --disable-tqdm were each 'unrecognized arguments' or an invalid choice."""
    proc = _bench("--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", f"{fault_server}/ok",
                  "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "10",
                  "--random-range-ratio", "0.5", "--num-prompts", "12", "--request-rate", "50", "--burstiness", "0.5",
                  "--max-concurrency", "2", "--seed", "3", "--disable-tqdm", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --disable-tqdm: no progress bar
    data = json.loads((tmp_path / "bench.json").read_text())
    config, (run,) = data["config"], data["runs"]
    assert (config["endpoint"], config["url"], config["dataset"]) == ("chat", f"{fault_server}/ok", "random")
    assert (run["rate"], run["concurrency"], config["burstiness"]) == (50.0, 2, 0.5)
    assert run["summary"]["completed"] == 12 and run["summary"]["total_output_tokens"] == 36  # delta chunks read
    assert {r["max_tokens"] for r in run["records"]} <= set(range(5, 16))  # 10 * (1 -+ 0.5), both ends included
    assert len({r["max_tokens"] for r in run["records"]}) > 1


@pytest.mark.parametrize("flags, message", [
    (["--backend", "tgi"], "argument --backend: 'tgi' is not one of openai, openai-chat, vllm"),
    (["--endpoint", "/v1/embeddings"], "argument --endpoint: invalid choice: '/v1/embeddings'"),
    (["--random-range-ratio", "1"], "argument --random-range-ratio: '1' must be in [0, 1)"),
    (["--random-range-ratio", "0.5", "--random-input-len", "4:8"], "--random-range-ratio needs a single"),
    (["--burstiness", "0"], "argument --burstiness: '0' must be > 0"),
])
def test_bad_vllm_flags_are_refused(flags, message):
    proc = _bench("--url", "http://127.0.0.1:9", "--num-requests", "1", *flags)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_save_result_writes_vllms_keys(fault_server, tmp_path):
    """--save-result, --result-dir, --percentile-metrics and --metric-percentiles were unrecognized, so a script
    reading vllm bench serve's result file (mean_ttft_ms, p99_itl_ms, ...) had nothing to read."""
    proc = _bench("--base-url", f"{fault_server}/ok", "--num-prompts", "5", "--request-rate", "inf",
                  "--max-concurrency", "2", "--random-input-len", "4", "--save-result", "--result-dir",
                  str(tmp_path / "vllm"), "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "25,99.9",
                  "--goodput", "ttft:60000", "e2el:60000", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "vllm").iterdir()
    assert re.fullmatch(r"openai-infqps-concurrency2-m-\d{8}-\d{6}\.json", path.name), path.name
    data = _strict_json(path.read_text())
    (run,) = json.loads((tmp_path / "out" / "bench.json").read_text())["runs"]
    summary, records = run["summary"], run["records"]
    assert (data["completed"], data["failed"], data["num_prompts"], data["max_concurrency"]) == (5, 0, 5, 2)
    assert (data["request_rate"], data["backend"], data["model_id"]) == ("inf", "openai", "m")
    assert summary["slo"] == {"ttft": 60000.0, "e2el": 60000.0}  # --goodput, vLLM's spelling of --slo
    assert data["request_goodput"] == data["request_throughput"] == summary["goodput"]
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert data[key] == summary[key if key != "duration" else "duration_s"]
    assert data["output_lens"] == [3] * 5 and data["ttfts"] == [r["ttft"] for r in records]
    assert data["itls"] == [r["itl"] for r in records]
    gaps = np.array([g for r in records for g in r["itl"]]) * 1000
    assert data["mean_itl_ms"] == pytest.approx(gaps.mean()) and data["std_itl_ms"] == pytest.approx(gaps.std())
    assert data["p25_itl_ms"] == pytest.approx(np.percentile(gaps, 25))
    assert data["p99.9_e2el_ms"] == pytest.approx(np.percentile([r["latency"] * 1000 for r in records], 99.9))
    assert data["median_ttft_ms"] == pytest.approx(summary["ttft_ms"]["p50"])
    assert not any(key.endswith("tpot_ms") for key in data)  # not among --percentile-metrics
    named = _bench("--url", f"{fault_server}/ok", "--num-requests", "1", "--save-result", "--result-dir",
                   str(tmp_path / "named"), "--result-filename", "r.json", "--backend", "openai-chat")
    assert named.returncode == 0 and _strict_json((tmp_path / "named" / "r.json").read_text())["backend"] == \
        "openai-chat"


@pytest.mark.parametrize("flags, message", [
    (["--percentile-metrics", "ttft,speed"], "argument --percentile-metrics: 'speed' is not one of ttft, tpot"),
    (["--metric-percentiles", "50,101"], "argument --metric-percentiles: '50,101': each percentile must be in"),
    (["--metric-percentiles", "x"], "argument --metric-percentiles: 'x' is not a comma-separated list"),
    (["--save-result", "--result-filename", "r.json", "--sweep", "1,2"], "--result-filename names one file"),
    (["--goodput", "ttft:50", "--slo", "tpot=5"], "--slo and --goodput: give one"),
    # the --rate was dropped without a word: each run of the sweep had its own
    (["--rate", "4", "--sweep", "1,2"], "--rate and --sweep: give one"),
])
def test_bad_result_flags_are_refused(flags, message):
    proc = _bench("--url", "http://127.0.0.1:9", "--num-requests", "1", *flags)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_run_without_matplotlib_keeps_its_result_and_succeeds(fault_server, tmp_path):
    """Without the bench extra, --out wrote bench.json and then ended with 'plots need matplotlib' and exit 1: a
    run that had succeeded read as failed, and nothing said that its result was written."""
    blocker = tmp_path / "site"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pdpool.cli", "bench", "--url", f"{fault_server}/ok", "--model", "m",
                           "--tokenizer", "none", "--no-progress", "--num-requests", "2", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'o' / 'bench.json'}" in proc.stdout
    assert "pdpool bench: no plots: they need matplotlib: pip install 'pdpool[bench]'" in proc.stderr
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["bench.json"]


def test_a_request_timeout_says_so(fault_server):
    """aiohttp's total timeout has no message: the summary read '2 of 2 requests failed: TimeoutError: '."""
    proc = _bench("--url", f"{fault_server}/slow", "--num-requests", "2", "--request-timeout", "0.3")
    assert proc.returncode == 1
    assert "pdpool bench: 2 of 2 requests failed: TimeoutError: no complete response within --request-timeout (0.3 s)" \
        in proc.stderr, proc.stderr


def _conversation(*turns: str) -> dict:
    speakers = ["human", "gpt"] * 3
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in zip(speakers, turns)]}


def test_sharegpt_dataset_as_vllm_samples_it(fault_server, tmp_path):
    """--dataset-name sharegpt, vLLM's most used dataset, was an invalid choice."""
    words = lambda n, w: " ".join([w] * n)  # noqa: E731
    data = [_conversation(words(5, "a"), words(6, "b")), _conversation(words(8, "c")),  # one turn: skipped
            _conversation(words(3, "d"), words(9, "e")),          # prompt under 4: skipped
            _conversation(words(6, "f"), words(2, "g")),          # completion under 4: skipped
            _conversation(words(1025, "h"), words(5, "i")),       # prompt over 1024: skipped
            _conversation(words(1000, "j"), words(1049, "k")),    # pair over 2048: skipped
            _conversation(words(7, "l"), words(4, "m"), words(3, "n")), "junk", {"conversations": "junk"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    proc = _bench("--url", f"{fault_server}/ok", "--dataset-name", "sharegpt", "--dataset-path", str(path),
                  "--num-prompts", "5", "--seed", "4", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads((tmp_path / "out" / "bench.json").read_text())["runs"]
    sent = [(r["prompt_tokens"], r["max_tokens"]) for r in run["records"]]
    assert len(sent) == 5 and set(sent) == {(5, 6), (7, 4)}  # the two valid pairs, cycled
    expected = datasets.sharegpt_requests(path, 5, datasets.Lengths(), seed=4)
    assert sent[:2] == [(r.prompt_len, r.max_tokens) for r in expected]  # seeded: the same order again
    fixed = datasets.sharegpt_requests(path, 5, datasets.Lengths(), 4, output_len=7)  # --sharegpt-output-len
    assert sorted((r.prompt_len, r.max_tokens) for r in fixed) == [(5, 7), (6, 7), (7, 7), (1000, 7)]  # 'g' is in
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="a ShareGPT file is a JSON list"):
        datasets.sharegpt_requests(path, 5, datasets.Lengths(), seed=0)


def test_custom_dataset_as_vllm_reads_it(fault_server, tmp_path, demo_model_dir):
    """--dataset-name custom was an invalid choice. vLLM's custom: JSONL prompts through the model's chat template
    (unless --skip-chat-template), shuffled (unless --disable-shuffle), max_tokens --custom-output-len (256)."""
    from pdpool.frontend import Frontend

    prompts = ["one two three", "four five six seven", "eight nine", "ten eleven twelve thirteen fourteen"]
    path = tmp_path / "custom.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    lengths = datasets.Lengths(Frontend.from_model("demo"))

    def run(*flags: str) -> list[tuple[int, int]]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        proc = _bench("--url", f"{fault_server}/ok", "--dataset-name", "custom", "--dataset-path", str(path),
                      "--tokenizer", "demo", "--seed", "1", "--out", str(out), *flags)
        assert proc.returncode == 0, proc.stderr
        (result,) = json.loads((out / "bench.json").read_text())["runs"]
        return [(r["prompt_tokens"], r["max_tokens"]) for r in result["records"]]

    templated = [lengths.count(lengths.frontend.render_chat([{"role": "user", "content": p}])) for p in prompts]
    assert run("--disable-shuffle") == [(n, 256) for n in templated]
    assert run("--disable-shuffle", "--skip-chat-template", "--custom-output-len", "9") == \
        [(lengths.count(p), 9) for p in prompts]
    shuffled = run()
    assert shuffled != [(n, 256) for n in templated] and sorted(shuffled) == sorted((n, 256) for n in templated)
    assert run() == shuffled  # seeded
    proc = _bench("--url", f"{fault_server}/ok", "--dataset-name", "custom", "--dataset-path", str(path))
    assert proc.returncode == 1 and "--dataset custom applies the model's chat template: give --tokenizer" in \
        proc.stderr, proc.stderr


def test_host_and_port_stand_for_the_url_as_in_vllm(fault_server, tmp_path):
    """vllm bench serve --host H --port P (its way when no --base-url is given) was refused: --url was required."""
    port = fault_server.rsplit(":", 1)[1]
    proc = _bench("--host", "127.0.0.1", "--port", port, "--num-prompts", "2", "--random-input-len", "4",
                  "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["config"]["url"] == fault_server and data["runs"][0]["summary"]["completed"] == 2


def test_percentile_flags_shape_the_table_and_summary_too(fault_server, tmp_path):
    """--metric-percentiles 95 and --percentile-metrics shaped only the --save-result file: the printed table (what
    vllm bench serve users read) and bench.json still gave p50, p90, p99 of all four metrics."""
    proc = _bench("--url", f"{fault_server}/ok", "--num-requests", "3", "--metric-percentiles", "95,99.9",
                  "--percentile-metrics", "ttft,e2el", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("(ms)"))
    assert header.split() == ["(ms)", "mean", "p50", "p95", "p99.9"]
    rows = [w[0] for w in map(str.split, proc.stdout.splitlines()) if w and w[0] in ("TTFT", "TPOT", "ITL", "E2EL")]
    assert rows == ["TTFT", "E2EL"]
    summary = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]
    assert list(summary["itl_ms"]) == ["mean", "p50", "p95", "p99.9"]  # every metric keeps its distribution


@settings(max_examples=scaled(200), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["prompt", "messages", "max_tokens", "other"]), _json, min_size=1, max_size=3))
def test_any_jsonl_line_gives_requests_or_an_error_naming_its_line(tmp_path_factory, item):
    """A JSONL line with a wrong type ('"max_tokens": null', '"prompt": 5', '"messages": 5') raised a TypeError or
    AttributeError out of the dataset reader: a traceback instead of 'FILE:LINE: ...'."""
    path = tmp_path_factory.mktemp("jsonl") / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n' + json.dumps(item) + "\n")
    try:
        reqs = datasets.jsonl_requests(path, 5, datasets.Lengths())
    except ValueError as exc:
        assert str(exc).startswith(f"{path}:2: "), exc
    else:
        assert len(reqs) == 2
        for r in reqs:
            assert isinstance(r.max_tokens, int) and r.max_tokens >= 1 and isinstance(r.prompt_len, int)
            assert isinstance(r.prompt, str) or r.messages is not None or (
                isinstance(r.prompt, list) and all(isinstance(t, int) for t in r.prompt))


def test_an_error_page_that_is_not_utf8_keeps_its_status(fault_server):
    """aiohttp's text() raised UnicodeDecodeError on it: the record said 'UnicodeDecodeError: ...', not the 502."""
    record = _send(f"{fault_server}/bad-gateway")
    assert not record.ok and record.error.startswith("HTTP 502: ") and "gateway down" in record.error


def test_usage_without_completion_tokens_is_counted_locally(fault_server):
    """A usage object without completion_tokens failed the request ('usage has no completion_tokens'), though its
    text had all come: now its prompt_tokens are taken and its output counted as a usage-less stream's."""
    record = _send(f"{fault_server}/partial-usage")
    assert record.ok and (record.prompt_tokens, record.completion_tokens, record.usage_reported) == (7, 2, False)
