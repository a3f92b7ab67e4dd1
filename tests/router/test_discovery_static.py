"""The load a statically named node reports on /metrics, read by the router's static discovery: a pdpool node's
unlabeled gauges and a vLLM server's labeled ones (one sample per engine when it runs data-parallel)."""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp
from aiohttp import web
from hypothesis import given, strategies as st

from pdpool.router.discovery_static import StaticDiscovery, parse_load
from pdpool.router.endpoints import Pool

# vLLM 0.32's exposition of the gauges the router reads (prometheus_client, labels model_name and engine)
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="demo",engine="0"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="demo",engine="0"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="demo",engine="0"} 0.42
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{model_name="demo",engine="0",reason="capacity"} 99.0
"""


def test_a_vllm_servers_labeled_gauges_are_read():
    """Before, only unlabeled lines matched: a vLLM node behind the router always read as idle and empty."""
    load = parse_load(VLLM_METRICS)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (3, 7, 0.42)


def test_a_pdpool_nodes_unlabeled_gauges_are_read():
    load = parse_load("vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.25\n"
                      "pdpool_kv_cache_free_blocks 96\n")
    assert (load.num_waiting, load.num_running, load.kv_usage, load.num_free_blocks) == (1, 2, 0.25, 96)


label_text = st.text(alphabet=st.sampled_from(list('ab {}=, "\\') + ["x"]), max_size=12).map(
    lambda t: t.replace("\\", "\\\\").replace('"', '\\"'))   # escaped as the text format escapes them


@given(engines=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000),
                                  st.floats(0, 1, allow_nan=False)), min_size=1, max_size=4),
       model=label_text, other=st.integers(0, 10**6))
def test_samples_of_a_data_parallel_server_are_summed_and_usage_averaged(engines, model, other):
    lines = []
    for i, (running, waiting, usage) in enumerate(engines):
        labels = f'model_name="{model}",engine="{i}"'
        lines += [f"vllm:num_requests_running{{{labels}}} {running}.0",
                  f"vllm:num_requests_waiting{{{labels}}} {waiting}",
                  f"vllm:kv_cache_usage_perc{{{labels}}} {usage!r}",
                  f'vllm:num_requests_running_by_stage{{{labels},stage="x"}} {other}']
    load = parse_load("\n".join(lines) + "\n")
    assert load.num_running == sum(e[0] for e in engines)
    assert load.num_waiting == sum(e[1] for e in engines)
    assert math.isclose(load.kv_usage, sum(e[2] for e in engines) / len(engines), abs_tol=1e-12)


def test_probes_log_a_nodes_state_and_a_foreign_prefill_node_once_per_change(caplog):
    """Probes run every --discovery-seconds (0.5 s by default): a vLLM server named as a prefill node was warned
    about at every probe, and a Kubernetes-discovered node was logged as a "static" one."""
    up = {"ready": True}
    caplog.set_level(logging.INFO, logger="pdpool.router")
    asyncio.run(_probe_a_foreign_prefill_node(up))
    url = up["url"]
    lines = [r.getMessage() for r in caplog.records if r.name == "pdpool.router"]
    assert lines == [f"prefill node {url} is ready", f"prefill node {url} is not a pdpool node; it cannot hand off KV",
                     f"prefill node {url} is not ready",
                     f"prefill node {url} is ready", f"prefill node {url} is not a pdpool node; it cannot hand off KV"]


async def _probe_a_foreign_prefill_node(up: dict) -> None:
    """A vLLM-like server (no /health/ready, owned_by vllm) probed 5 times, down once, then 3 more times."""

    async def models(request):
        if not up["ready"]:
            return web.Response(status=503)
        return web.json_response({"object": "list", "data": [{"id": "demo", "owned_by": "vllm"}]})

    async def metrics(request):
        return web.Response(text="vllm:num_requests_running 0\n")

    app = web.Application()
    app.router.add_get("/v1/models", models)     # no /health/ready: a 404 there, as vLLM answers
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up["url"] = url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            discovery = StaticDiscovery({"prefill": [url]}, Pool(), session, period=0.5)
            for _ in range(5):
                await discovery.refresh()
            up["ready"] = False
            await discovery.refresh()
            up["ready"] = True
            for _ in range(3):
                await discovery.refresh()
    finally:
        await runner.cleanup()
