"""Real kopf against the emulator: discovery, list+watch, status patches and events."""

import asyncio
import os
import subprocess
import sys
import threading
import time

import kopf
import pytest
from emulator_builders import CRDS, WIDGETS, make_widget, make_widget_crd


def make_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        settings.posting.level = 0
        settings.watching.server_timeout = 10
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="emulator.test")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="emulator.test")

    @kopf.on.create("example.com", "v1", "widgets", registry=registry)
    def created(body, spec, patch, **_):
        patch.status["phase"] = f"Ready:{spec['replicas']}"
        kopf.info(body, reason="Created", message="widget created")  # posted as a core/v1 Event

    @kopf.on.delete("example.com", "v1", "widgets", registry=registry)
    def deleted(**_):
        pass

    return registry


class Operator:
    """kopf.operator() in its own thread and loop, stopped through stop_flag."""

    def __init__(self, url: str):
        self.url = url
        self.registry = make_registry()

        @kopf.on.login(registry=self.registry)
        def login(**_):
            return kopf.ConnectionInfo(server=url, insecure=True)

        self.ready, self.stop_flag = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.run(kopf.operator(registry=self.registry, standalone=True, namespaces=["default"],
                                  ready_flag=self.ready, stop_flag=self.stop_flag))

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(20), "kopf did not start"
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join(20)


def wait_for(probe, timeout=20.0):
    deadline = time.monotonic() + timeout
    while (value := probe()) is None or value is False:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


@pytest.mark.timeout(60)
def test_kopf_reacts_to_a_custom_resource(k8s):
    client = k8s.client()
    client.post(CRDS, make_widget_crd())
    with Operator(k8s.url):
        client.post(WIDGETS, make_widget(replicas=2))
        status = wait_for(lambda: client.get(f"{WIDGETS}/w1").body.get("status"))
        assert status["phase"] == "Ready:2"
        kopf_writes = [w for w in k8s.writes(resource="widgets") if w["user_agent"].startswith("kopf")]
        assert any(w["subresource"] == "status" for w in kopf_writes)
        events = wait_for(lambda: [e for e in client.get("/api/v1/namespaces/default/events").body["items"]
                                   if e["involvedObject"].get("name") == "w1"] or None)
        assert (events[0]["reason"], events[0]["source"]["component"]) == ("Created", "kopf")
        obj = client.get(f"{WIDGETS}/w1").body
        assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        client.delete(f"{WIDGETS}/w1")
        wait_for(lambda: client.get(f"{WIDGETS}/w1").status == 404)


OPERATOR_SOURCE = '''
import kopf

@kopf.on.create("example.com", "v1", "widgets")
def created(spec, patch, **_):
    patch.status["phase"] = "Seen:" + spec["model"]
'''


@pytest.mark.timeout(60)
def test_kopf_run_with_a_kubeconfig(k8s, kubeconfig, tmp_path):
    """`kopf run --standalone` in a subprocess, logging in through the kubeconfig file."""
    client = k8s.client()
    client.post(CRDS, make_widget_crd())
    client.post(WIDGETS, make_widget())
    source = tmp_path / "operator.py"
    source.write_text(OPERATOR_SOURCE)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    process = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "-n", "default", str(source)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status = wait_for(lambda: client.get(f"{WIDGETS}/w1").body.get("status"))
        assert status == {"phase": "Seen:tiny"}
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0]
    assert "login_with_kubeconfig' succeeded" in output
