"""``pdpool router --workers N``: N processes serve one port (SO_REUSEPORT), a scrape of any of them sees the
totals of all, SIGTERM stops them all, a worker that dies is replaced, and a taken port is a clear error.

The upstream is the overhead benchmark's fast OpenAI server (``benchmarks/router_stub_upstream.py``, a real
aiohttp process): what is under test is the router's process model, not the nodes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdpool.node_process import free_port, parse_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from listen_checks import loopbacks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = 2


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/router_stub_upstream.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the upstream did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def pids_answering(url: str, want: int, tries: int = 400) -> set[int]:
    """Pids behind ``url``, one new connection per request, until ``want`` differ (the kernel hashes each
    connection to one worker's socket)."""
    seen: set[int] = set()
    for _ in range(tries):
        with httpx.Client() as c:
            seen.add(c.get(url + "/health/live", timeout=5).json()["pid"])
        if len(seen) >= want:
            break
    return seen


def scrape(url: str) -> dict[str, float]:
    with httpx.Client() as c:
        return parse_metrics(c.get(url + "/metrics", timeout=5).text)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def replaced(url: str, victim: int, timeout: float = 30) -> set[int]:
    """The pids answering once ``victim`` is gone and a new worker answers in its place."""
    deadline = time.monotonic() + timeout
    while True:
        now = pids_answering(url, N, tries=50)
        if len(now) == N and victim not in now:
            return now
        assert time.monotonic() < deadline, f"worker {victim} was not replaced: {now}"
        time.sleep(0.2)


def complete(url: str, n: int) -> None:
    for i in range(n):
        with httpx.Client() as c:   # a new connection each time: the requests spread over the workers
            r = c.post(url + "/v1/completions", json={"model": "demo", "prompt": f"hello {i}", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200, r.text


def test_workers_share_a_port_and_the_metrics_and_stop_together(upstream, start_router):
    router = start_router(["--both", upstream, "--workers", str(N)], name="workers")
    workers = pids_answering(router.url, N)
    assert len(workers) == N and router.proc.pid not in workers

    complete(router.url, 30)
    for _ in range(6):  # whichever worker answers the scrape reports every worker's requests
        m = scrape(router.url)
        assert m['pdpool_router_requests_total{decision="decode_only"}'] == 30
        assert m["pdpool_router_decision_seconds_count"] == 30
        assert m['pdpool_router_responses_total{status="200"}'] == 30   # not the probes and scrapes here
        assert m['pdpool_router_nodes{role="both",usable="true"}'] == 1
        assert m['pdpool_router_index_mode{mode="approximate"}'] == 1

    # A worker that dies is replaced; the counts it had made stay in the totals.
    victim = next(iter(workers))
    os.kill(victim, signal.SIGKILL)
    now = replaced(router.url, victim)
    complete(router.url, 10)
    assert scrape(router.url)['pdpool_router_requests_total{decision="decode_only"}'] == 40

    # SIGTERM to the supervisor stops every worker, then the supervisor, cleanly.
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in now):
        assert time.monotonic() < deadline, "a worker outlived its supervisor"
        time.sleep(0.1)



def test_probes_and_scrapes_are_not_counted_as_responses(upstream, start_router):
    """``pdpool_router_responses_total`` counts the API's answers: a kubelet's probes (a not-ready 503 among them)
    and Prometheus's scrapes are not an error rate. They were all counted (one process and N alike)."""
    router = start_router(["--both", upstream], name="one-process")
    for _ in range(5):
        for path in ("/health/live", "/health/ready", "/health", "/metrics", "/openapi.json"):
            assert httpx.get(router.url + path, timeout=5).status_code == 200
    complete(router.url, 3)
    m = scrape(router.url)
    assert {k: v for k, v in m.items() if k.startswith("pdpool_router_responses_total")} == {
        'pdpool_router_responses_total{status="200"}': 3}


@pytest.mark.parametrize("workers", [1, N])
def test_without_host_every_worker_answers_on_ipv4_and_ipv6(upstream, start_router, workers):
    """The router listened on 0.0.0.0: in an IPv6-only cluster the kubelet's probes (the pod's IPv6 address) were
    refused. Each worker binds the addresses its supervisor checked, so all of them answer on both."""
    router = start_router(["--both", upstream, "--workers", str(workers)], name=f"every-address-{workers}",
                          every_address=True)
    for host in loopbacks():
        url = f"http://{host}:{router.port}"
        answering = pids_answering(url, workers)
        assert len(answering) == workers, (host, answering)
        complete(url, 2)
    assert "listening on http://0.0.0.0:" in router.log_tail(20000)


def test_a_taken_port_is_a_clear_error(upstream, start_router):
    first = start_router(["--both", upstream, "--workers", str(N)], name="port-owner")
    second = subprocess.run([sys.executable, "-m", "pdpool.cli", "router", "--model", "demo", "--host", "127.0.0.1",
                             "--port", str(first.port), "--both", upstream, "--workers", str(N)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "cannot listen on" in second.stderr, second.stderr
    assert len(pids_answering(first.url, N)) == N  # the first router still owns its port, whole


def test_workers_die_with_a_killed_supervisor(upstream, start_router, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # inherited by the router: its metrics folder lands here
    router = start_router(["--both", upstream, "--workers", str(N)], name="orphans")
    workers = pids_answering(router.url, N)
    metrics_dirs = list(tmp_path.glob("pdpool-router-metrics-*"))  # the supervisor's, in its TMPDIR
    assert len(metrics_dirs) == 1
    router.kill()  # SIGKILL: no chance to pass anything on; PR_SET_PDEATHSIG does
    # The kernel sends the death signal again each time a worker is handed on to a new parent (the supervisor's
    # threads exit one by one): many more of them, at any moment of the drain and the cleanup, change nothing.
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers):
        assert time.monotonic() < deadline, "workers outlived a SIGKILLed supervisor"
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGHUP)
        time.sleep(0.002)
    assert not metrics_dirs[0].exists(), sorted(p.name for p in metrics_dirs[0].iterdir())


def test_a_stray_hangup_restarts_one_worker_and_keeps_the_shared_metrics(upstream, start_router, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    router = start_router(["--both", upstream, "--workers", str(N)], name="hangup")
    workers = pids_answering(router.url, N)
    complete(router.url, 4)
    victim = next(iter(workers))
    for _ in range(20):                # a burst, as from `pkill -HUP`: the worker drains, exits 0, is replaced
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGHUP)
        time.sleep(0.002)
    replaced(router.url, victim)
    assert f"(pid {victim}) exited with 0" in router.log_path.read_text()
    assert len(list(tmp_path.glob("pdpool-router-metrics-*"))) == 1   # the supervisor is alive: its folder stays
    complete(router.url, 4)
    assert scrape(router.url)['pdpool_router_requests_total{decision="decode_only"}'] == 8
