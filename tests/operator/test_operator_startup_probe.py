"""A node pod's startupProbe bounds the model load by ``model.loadTimeoutSeconds``, as docs/deploy.md says: a
``pdpool serve`` listens at once and loads the engine on a thread, so the probe must ask whether the load is done,
not whether the process answers (``/health/live`` answers 200 from the first moment: a probe on it passed at once,
and a load that hung was never restarted)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from operator_examples import example_body
from pdpool.node_process import NodeProcess
from pdpool.operator import builders
from pdpool.operator.spec import parse_pool


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_startup_probe_fails_while_a_real_node_loads(tmp_path):
    objs = builders.render(parse_pool(example_body("cpu-demo")), token=lambda: "t")
    (deployment,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-decode"]
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600   # loadTimeoutSeconds' default
    node = NodeProcess("node")
    node.launch(node.serve_argv([]), log_path=tmp_path / "node.log")
    try:
        seen = []   # (startup probe's status, /health/ready's status) while the node answers
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                answer = (_status(node.url + probe["httpGet"]["path"]), _status(node.url + "/health/ready"))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)   # not listening yet
                continue
            seen.append(answer)
            if answer[1] == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1][1] == 200, node.log_tail()
        loading = [startup for startup, ready in seen if ready != 200]
        assert loading, "the node was never seen loading"
        assert all(status >= 400 for status in loading), seen   # the kubelet counts these as failures
        assert _status(node.url + probe["httpGet"]["path"]) == 200   # and passes once loaded
    finally:
        node.stop()
