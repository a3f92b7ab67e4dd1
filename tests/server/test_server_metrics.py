"""/metrics names and values; a client that goes away gives its KV blocks back."""

from __future__ import annotations

import json
import time

import httpx

GAUGES = ["pdpool_num_requests_running", "pdpool_num_requests_waiting", "pdpool_kv_cache_usage_perc",
          "pdpool_kv_cache_free_blocks", "pdpool_prefix_cache_hit_rate",
          "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["pdpool_prefill_chunks_total", "pdpool_prefix_cache_hit_tokens_total", "pdpool_preemptions_total",
            "pdpool_generation_tokens_total", "pdpool_prompt_tokens_total"]
HISTOGRAMS = ["pdpool_time_to_first_token_seconds", "pdpool_inter_token_latency_seconds"]


def wait_for(predicate, timeout=30.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def idle(server) -> dict:
    """Metrics once nothing runs or waits."""
    return wait_for(lambda: (m := server.metrics())["pdpool_num_requests_running"] == 0
                    and m["pdpool_num_requests_waiting"] == 0 and m)


def test_metric_names_and_cache_config(server, client):
    client.completions.create(model="demo", prompt="Hello there", max_tokens=3, temperature=0)
    m = idle(server)
    for name in GAUGES + COUNTERS:
        assert name in m, name
    for name in HISTOGRAMS:
        assert m[name + "_count"] >= 1, name
    info = f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{server.num_kv_blocks}"}}'
    assert m[info] == 1.0
    assert m["pdpool_kv_cache_free_blocks"] == server.num_kv_blocks
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["pdpool_generation_tokens_total"] >= 3


def test_ttft_and_itl_are_observed_per_request(server, client):
    before = server.metrics()
    client.completions.create(model="demo", prompt="One two three", max_tokens=5, temperature=0)
    after = idle(server)
    assert after["pdpool_time_to_first_token_seconds_count"] == before["pdpool_time_to_first_token_seconds_count"] + 1
    assert after["pdpool_inter_token_latency_seconds_count"] == before["pdpool_inter_token_latency_seconds_count"] + 4


def test_stream_disconnect_returns_blocks(server):
    total = idle(server)["pdpool_kv_cache_free_blocks"]
    body = {"model": "demo", "prompt": "Write a very long essay about the sea. " * 8, "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers()) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    seen += 1
                if seen >= 2:
                    break
            busy = server.metrics()
            assert busy["pdpool_num_requests_running"] == 1
            assert busy["pdpool_kv_cache_free_blocks"] < total
        # leaving the block closes the connection mid-stream
    m = wait_for(lambda: (m := server.metrics())["pdpool_num_requests_running"] == 0 and m)
    assert m["pdpool_kv_cache_free_blocks"] == total
    assert m["pdpool_generation_tokens_total"] < busy["pdpool_generation_tokens_total"] + 200


def test_non_streaming_disconnect_returns_blocks(server):
    total = idle(server)["pdpool_kv_cache_free_blocks"]
    body = {"model": "demo", "prompt": "List every prime number.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    try:
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=1.5)
        raise AssertionError("400 tokens should take longer than 1.5 s on one CPU thread")
    except httpx.ReadTimeout:
        pass  # the client hangs up
    m = wait_for(lambda: (m := server.metrics())["pdpool_num_requests_running"] == 0
                 and m["pdpool_kv_cache_free_blocks"] == total and m)
    assert m["pdpool_num_requests_waiting"] == 0
