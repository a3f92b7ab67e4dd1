"""A decode node still loading its model that is handed a request (a vLLM-style proxy sends to it without asking its
readiness; the router would not) answers 503, and releases the prefill node's lease at once rather than leave the
blocks held to expiry, counted against the prefill node's ``--max-leased-blocks`` meanwhile. A handle naming an
address the pool's index does not have for its node gets no call (and no internal token), as from a loaded node.

Nodes: ``pl`` prefill (lease 30 s); ``dl`` decode whose weights file is a FIFO nobody writes, so it stays loading.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from cluster import Node, assert_no_leaks, completion_body, wait_for
from proxy import DisaggProxy
from test_faults import Listener

PROMPT = "The capital of France is a city that has many famous museums, such as the"


class LoadingNode(Node):
    """A pool node whose load never ends: its model's weights file is a FIFO."""

    def __init__(self, model_dir, *args) -> None:
        self.model_dir = model_dir
        super().__init__(*args)

    def serve_argv(self, flags: list[str], model: str = "demo") -> list[str]:
        return super().serve_argv(flags, model=str(self.model_dir))


@pytest.fixture(scope="module")
def nodes(start_nodes, demo_model_dir, tmp_path_factory, redis_module):
    model = tmp_path_factory.mktemp("loading-model")
    for f in demo_model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, model / f.name)
    os.mkfifo(model / "model.safetensors")
    pl = start_nodes({"pl": ("prefill", ["--kv-lease-seconds", "30"])})["pl"]
    dl = LoadingNode(model, "dl", "decode", [], tmp_path_factory.mktemp("loading-logs"), redis_module.url)
    try:
        deadline = time.monotonic() + 120
        while dl.readiness()[0] != "loading":
            assert dl.alive and time.monotonic() < deadline, dl.log_tail()
            time.sleep(0.2)
        yield {"pl": pl, "dl": dl}
    finally:
        dl.stop()


def test_a_handoff_to_a_node_still_loading_is_a_503_and_ends_the_lease(nodes):
    pl, dl = nodes["pl"], nodes["dl"]
    start = pl.kv()["free"]
    proxy = DisaggProxy(pl.url, dl.url)
    body = completion_body(PROMPT, 4)
    handle = proxy.handle(body)
    assert pl.kv()["leases"] == 1
    r = proxy.decode(body, handle)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"], r.text
    wait_for(lambda: pl.kv()["leases"] == 0, 5, "the loading decode node to release the lease")
    assert pl.kv()["expiries"] == 0
    assert dl.readiness()[0] == "loading"
    assert_no_leaks([pl], {"pl": start})


def test_a_handle_naming_another_address_gets_no_call_from_a_loading_node(nodes):
    pl, dl = nodes["pl"], nodes["dl"]
    proxy = DisaggProxy(pl.url, dl.url)
    body = completion_body(PROMPT + " Louvre", 4)
    handle = proxy.handle(body)
    listener = Listener()
    try:
        r = proxy.decode(body, {**handle, "remote_port": listener.port})
        assert r.status_code == 503, r.text
        time.sleep(1.0)
    finally:
        listener.close()
    assert listener.seen == []
    assert pl.kv()["leases"] == 1   # not released by the edited handle; the real one ends it
    assert proxy.decode(body, handle).status_code == 503
    wait_for(lambda: pl.kv()["leases"] == 0, 5, "the loading decode node to release the lease")
