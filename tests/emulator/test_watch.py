"""Watch streams: event order, resuming from a resourceVersion, bookmarks, selectors, timeouts."""

import threading
import time

from emulator_builders import CONFIGMAPS, make_configmap


def collect(client, path, params, until, timeout=10):
    """Runs a watch in a thread; returns (events, thread). Stops when `until(events)` holds."""
    events = []

    def run():
        for event in client.watch(path, params, timeout=timeout):
            events.append(event)
            if until(events):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return events, thread


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_events_arrive_in_order(k8s):
    client = k8s.client()
    start = client.get(CONFIGMAPS).body["metadata"]["resourceVersion"]
    events, thread = collect(client, CONFIGMAPS, {"resourceVersion": start}, lambda e: len(e) == 3)
    time.sleep(0.2)
    client.post(CONFIGMAPS, make_configmap())
    client.patch(f"{CONFIGMAPS}/cm", {"data": {"k": "2"}})
    client.delete(f"{CONFIGMAPS}/cm")
    thread.join(5)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert events[1]["object"]["data"] == {"k": "2"}


def test_resume_from_resource_version(k8s):
    client = k8s.client()
    first = client.post(CONFIGMAPS, make_configmap("a")).body
    client.post(CONFIGMAPS, make_configmap("b"))
    client.patch(f"{CONFIGMAPS}/a", {"data": {"k": "changed"}})
    events, thread = collect(client, CONFIGMAPS, {"resourceVersion": first["metadata"]["resourceVersion"]},
                             lambda e: len(e) == 2)
    thread.join(5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("MODIFIED", "a")]


def test_watch_without_resource_version_starts_with_current_state(k8s):
    client = k8s.client()
    client.post(CONFIGMAPS, make_configmap("a"))
    events, thread = collect(client, CONFIGMAPS, {}, lambda e: len(e) == 1)
    thread.join(5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a")]


def test_bookmarks_and_initial_events_end(k8s):
    client = k8s.client()
    client.post(CONFIGMAPS, make_configmap("a"))
    params = {"allowWatchBookmarks": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan"}
    events, thread = collect(client, CONFIGMAPS, params, lambda e: len(e) == 3)
    thread.join(5)
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert events[2]["object"]["kind"] == "ConfigMap" and events[2]["object"]["metadata"]["resourceVersion"]


def test_selectors_filter_events_and_timeout_ends_stream(k8s):
    client = k8s.client()
    params = {"resourceVersion": "1", "labelSelector": "app=x", "fieldSelector": "metadata.name=a",
              "timeoutSeconds": "1"}
    started = time.monotonic()
    client.post(CONFIGMAPS, make_configmap("a", labels={"app": "x"}))
    client.post(CONFIGMAPS, make_configmap("b", labels={"app": "x"}))
    client.post(CONFIGMAPS, make_configmap("c"))
    events = list(client.watch(CONFIGMAPS, params))
    assert [e["object"]["metadata"]["name"] for e in events] == ["a"]
    assert 0.9 < time.monotonic() - started < 15


def test_cluster_wide_watch_sees_all_namespaces(k8s):
    client = k8s.client()
    client.post("/api/v1/namespaces", {"metadata": {"name": "other"}})
    events, thread = collect(client, "/api/v1/configmaps", {"resourceVersion": "1"}, lambda e: len(e) == 2)
    client.post(CONFIGMAPS, make_configmap("a"))
    client.post("/api/v1/namespaces/other/configmaps", make_configmap("b"))
    thread.join(5)
    assert sorted(e["object"]["metadata"]["namespace"] for e in events) == ["default", "other"]


def test_closed_watches_are_released(k8s):
    client = k8s.client()
    for event in client.watch(CONFIGMAPS, {"resourceVersion": "1", "allowWatchBookmarks": "true"}):
        assert event["type"] == "BOOKMARK"
        break
    wait_for(lambda: k8s.store.watcher_count() == 0)


def test_too_old_resource_version_is_expired():
    from k8s_emulator import Emulator

    with Emulator(watch_history=2) as k8s:
        client = k8s.client()
        first = client.post(CONFIGMAPS, make_configmap("a")).body
        for name in "bcd":
            client.post(CONFIGMAPS, make_configmap(name))
        events = list(client.watch(CONFIGMAPS, {"resourceVersion": first["metadata"]["resourceVersion"]}))
        assert [e["type"] for e in events] == ["ERROR"]
        assert (events[0]["object"]["code"], events[0]["object"]["reason"]) == (410, "Expired")


def test_objects_entering_and_leaving_a_selector(k8s):
    client = k8s.client()
    client.post(CONFIGMAPS, make_configmap("a"))
    events, thread = collect(client, CONFIGMAPS, {"resourceVersion": "1", "labelSelector": "app=x"},
                             lambda e: len(e) == 3)
    client.patch(f"{CONFIGMAPS}/a", {"metadata": {"labels": {"app": "x"}}})
    client.patch(f"{CONFIGMAPS}/a", {"data": {"k": "2"}})
    client.patch(f"{CONFIGMAPS}/a", {"metadata": {"labels": {"app": "y"}}})
    thread.join(5)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
