"""The node's lifecycle and limits against real node processes: a stop while the model loads, the bounded waiting
queue, X-Request-Id, the router's token-id extension."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdpool.node_process import NodeProcess


def test_sigterm_while_loading_stops_the_node(demo_model_dir, tmp_path):
    """A load that never ends (its weights file is a FIFO nobody writes) must not hold a SIGTERM: the node exits."""
    model = tmp_path / "stuck-model"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, model / f.name)
    os.mkfifo(model / "model.safetensors")
    node = NodeProcess("stuck")
    node.launch(node.serve_argv(["--dtype", "float32"], model=str(model)), dict(os.environ), tmp_path / "stuck.log")
    try:
        deadline = time.monotonic() + 120
        while node.readiness()[0] != "loading":
            assert node.alive and time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
        time.sleep(1.0)  # the load thread is inside the open() of the FIFO now
        assert node.readiness()[0] == "loading"
        node.signal(signal.SIGTERM)
        node.proc.wait(timeout=20)
        assert "stopping while the model loads" in node.log_tail()
    finally:
        node.kill()


def test_a_model_folder_that_does_not_exist_is_a_command_line_error(tmp_path):
    """No server starts for a --model that cannot load: exit status 2 and one line naming the flag, at once (vLLM
    fails at once too), not a node that listens and is never ready."""
    node = NodeProcess("no-model")
    node.launch(node.serve_argv([], model=str(tmp_path / "missing")), dict(os.environ), tmp_path / "missing.log")
    try:
        assert node.proc.wait(timeout=60) == 2
        tail = node.log_tail()
        assert "pdpool serve: error: --model" in tail and "missing" in tail and "Traceback" not in tail, tail
    finally:
        node.kill()


def test_an_engine_that_fails_to_load_ends_the_node_with_status_1(demo_model_dir, tmp_path):
    """A model folder whose weights are not safetensors: the load fails after the server listens. The node logs
    the traceback and exits with status 1 and the reason, so a supervisor (Kubernetes, pdpool up) restarts it,
    where it used to stay up, live and never ready."""
    model = tmp_path / "broken-model"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, model / f.name)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    node = NodeProcess("broken")
    node.launch(node.serve_argv(["--dtype", "float32"], model=str(model)), dict(os.environ), tmp_path / "broken.log")
    try:
        assert node.proc.wait(timeout=180) == 1, node.log_tail()
        tail = node.log_tail()
        assert "engine failed to load" in tail and "pdpool serve: the engine failed to load:" in tail, tail
    finally:
        node.kill()


@pytest.fixture(scope="module")
def small_queue(launch_server):
    srv = launch_server("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                        "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield srv
    srv.stop()


def test_waiting_queue_is_bounded_with_429(small_queue):
    body = {"model": "demo", "prompt": "Count to one hundred:", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=small_queue.url, timeout=300) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(6)])

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 429}, codes
    for r in replies:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "--max-waiting-requests" in err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    m = small_queue.metrics()
    assert m["pdpool_num_requests_running"] == m["pdpool_num_requests_waiting"] == 0
    assert m["pdpool_kv_cache_free_blocks"] == 64


def test_request_id_travels_and_comes_back(small_queue):
    r = httpx.post(small_queue.url + "/v1/completions", headers={"X-Request-Id": "trace-42"},
                   json={"model": "demo", "prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    generated = httpx.post(small_queue.url + "/v1/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 1},
                           timeout=120)
    assert len(generated.headers["X-Request-Id"]) == 32
    bad = httpx.post(small_queue.url + "/v1/completions", headers={"X-Request-Id": "x" * 500}, json={}, timeout=30)
    assert bad.status_code == 400 and bad.headers["X-Request-Id"] != "x" * 500


def test_forwarded_token_ids_replace_tokenization(small_queue, demo_model_dir):
    """A router's ``pdpool_prompt_token_ids`` are used as they are (here: ids of another text than the prompt)."""
    from pdpool.frontend import Frontend

    frontend = Frontend.from_model(str(demo_model_dir))
    ids = frontend.encode_prompt("The capital of France is")
    base = {"model": "demo", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    direct = httpx.post(small_queue.url + "/v1/completions", json={**base, "prompt": "The capital of France is"},
                        timeout=120).json()
    forwarded = httpx.post(small_queue.url + "/v1/completions",
                           json={**base, "prompt": "ignored text", "pdpool_prompt_token_ids": [ids]}, timeout=120).json()
    assert forwarded["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert forwarded["usage"]["prompt_tokens"] == len(ids)
    chat = {"model": "demo", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    for bad in ([], [[]], [ids, ids], [[1.5]], "ids", [[10 ** 9]]):
        r = httpx.post(small_queue.url + "/v1/chat/completions", json={**chat, "pdpool_prompt_token_ids": bad},
                       timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert json.loads(r.text)["error"]["param"] in ("pdpool_prompt_token_ids", "prompt")


def test_request_id_comes_back_on_a_stream(small_queue):
    """A streamed answer is prepared inside its handler, before the middleware could add the header."""
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", small_queue.url + "/v1/completions", headers={"X-Request-Id": "trace-stream-7"},
                      json=body, timeout=120) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "trace-stream-7"
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["id"] == "cmpl-trace-stream-7"
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", small_queue.url + "/v1/chat/completions", json=chat, timeout=120) as r:
        first = next(line for line in r.iter_lines() if line)
    assert json.loads(first[6:])["id"] == "chatcmpl-" + r.headers["X-Request-Id"]
