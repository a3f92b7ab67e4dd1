"""A decode node stopped while a KV load is in flight shuts down in order (item 9 of the node-core issue): the
request in flight finishes (its transfer ends, the notification to the prefill node still goes out over the
HTTP session), then the engine stops, then the NIXL memory is deregistered, then the session closes. The old
order closed the session first and deregistered memory a transfer could still be writing."""

from __future__ import annotations

import signal
import threading
import time

from cluster import completion_body, token_ids, wait_for
from proxy import DisaggProxy

FLAGS = ["--kv-lease-seconds", "30", "--kv-transfer-timeout", "10"]
PROMPT = "Once upon a time, in a small village at the edge of a dark forest, there lived a"


def test_stop_during_a_transfer_finishes_it_then_stops_in_order(start_nodes):
    nodes = start_nodes({"pf-stop": ("prefill", FLAGS), "df-stop": ("decode", FLAGS)})
    pf, df = nodes["pf-stop"], nodes["df-stop"]
    proxy = DisaggProxy(pf.url, df.url)
    body = completion_body(PROMPT, max_tokens=6)
    expected = token_ids(df.complete(body))
    handle = proxy.handle(body)
    assert pf.kv()["leases"] == 1
    handle = {**handle, "pdpool_test_hold": {"point": "after_transfer", "seconds": 2.0}}
    result: dict = {}

    def decode():
        result["response"] = proxy.decode(body, handle)

    client = threading.Thread(target=decode)
    client.start()
    wait_for(lambda: df.value("pdpool_kv_pulled_bytes_total") > 0, timeout=30, what="the pull to start")
    df.signal(signal.SIGTERM)  # the load is held after its READ, before the notification
    client.join(timeout=60)
    r = result["response"]
    assert r.status_code == 200, r.text
    assert token_ids(r.json()) == expected
    assert df.proc.wait(timeout=60) == 0
    log = df.log_tail(20000)
    assert "Traceback" not in log and "Session is closed" not in log, log
    # The notification reached the prefill node before the session closed: the lease ended at once, not by expiry.
    wait_for(lambda: pf.kv()["leases"] == 0, timeout=5, what="the lease to end by notification")
    assert pf.value("pdpool_kv_lease_expiries_total") == 0
    time.sleep(0.1)
