"""Documented API-server behaviour: status codes, generation, resourceVersion, subresources, deletion."""

import pytest
from emulator_builders import CONFIGMAPS, DEPLOYMENTS, make_configmap, make_deployment
from k8s_emulator import ApiError


@pytest.fixture
def client(k8s):
    return k8s.client()


def test_create_get_update_status_codes(client):
    created = client.post(DEPLOYMENTS, make_deployment())
    assert created.status == 201
    meta = created.body["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"] and meta["namespace"] == "default"
    assert client.get(f"{DEPLOYMENTS}/web").status == 200
    again = client.post(DEPLOYMENTS, make_deployment())
    assert (again.status, again.reason) == (409, "AlreadyExists")
    assert again.body["kind"] == "Status" and again.body["details"]["name"] == "web"
    missing = client.get(f"{DEPLOYMENTS}/nope")
    assert (missing.status, missing.reason) == (404, "NotFound")
    assert missing.body["message"] == 'deployments.apps "nope" not found'
    updated = client.put(f"{DEPLOYMENTS}/web", created.body | {"spec": {**created.body["spec"], "replicas": 3}})
    assert updated.status == 200 and updated.body["spec"]["replicas"] == 3


def test_generation_counts_spec_changes_only(client):
    obj = client.post(DEPLOYMENTS, make_deployment()).body
    labelled = client.patch(f"{DEPLOYMENTS}/web", {"metadata": {"labels": {"extra": "x"}}}).body
    assert labelled["metadata"]["generation"] == 1
    status = client.patch(f"{DEPLOYMENTS}/web/status", {"status": {"readyReplicas": 2}}).body
    assert status["metadata"]["generation"] == 1
    scaled = client.patch(f"{DEPLOYMENTS}/web", {"spec": {"replicas": 5}}).body
    assert scaled["metadata"]["generation"] == 2
    assert int(scaled["metadata"]["resourceVersion"]) > int(obj["metadata"]["resourceVersion"])


def test_resource_version_is_monotonic_and_stale_writes_conflict(client):
    first = client.post(CONFIGMAPS, make_configmap("a")).body
    second = client.post(CONFIGMAPS, make_configmap("b")).body
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    fresh = client.put(f"{CONFIGMAPS}/a", first | {"data": {"k": "new"}})
    assert fresh.status == 200
    stale = client.put(f"{CONFIGMAPS}/a", first | {"data": {"k": "stale"}})
    assert (stale.status, stale.reason) == (409, "Conflict")
    assert "the object has been modified" in stale.body["message"]
    old_version = {"resourceVersion": first["metadata"]["resourceVersion"]}
    stale_patch = client.patch(f"{CONFIGMAPS}/a", {"metadata": old_version, "data": {"k": "x"}})
    assert stale_patch.status == 409
    listed = client.get(CONFIGMAPS).body
    assert listed["kind"] == "ConfigMapList" and int(listed["metadata"]["resourceVersion"]) >= int(
        fresh.body["metadata"]["resourceVersion"])


def test_noop_update_keeps_resource_version(client):
    obj = client.post(CONFIGMAPS, make_configmap()).body
    same = client.patch(f"{CONFIGMAPS}/cm", {"data": {"k": "v"}}).body
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_status_subresource_isolation(client):
    client.post(DEPLOYMENTS, make_deployment() | {"status": {"replicas": 99}})
    assert "replicas" not in client.get(f"{DEPLOYMENTS}/web").body.get("status", {})
    client.patch(f"{DEPLOYMENTS}/web/status", {"status": {"readyReplicas": 1}, "spec": {"replicas": 7},
                                               "metadata": {"labels": {"ignored": "yes"}}})
    obj = client.get(f"{DEPLOYMENTS}/web").body
    assert obj["status"] == {"readyReplicas": 1}
    assert obj["spec"]["replicas"] == 2 and "ignored" not in obj["metadata"]["labels"]
    client.patch(f"{DEPLOYMENTS}/web", {"status": {"readyReplicas": 5}, "spec": {"replicas": 3}})
    obj = client.get(f"{DEPLOYMENTS}/web").body
    assert obj["status"] == {"readyReplicas": 1} and obj["spec"]["replicas"] == 3
    put = client.put(f"{DEPLOYMENTS}/web/status", obj | {"status": {"readyReplicas": 3}})
    assert put.status == 200 and put.body["status"] == {"readyReplicas": 3}
    no_status = client.patch(f"{CONFIGMAPS}/x/status", {})
    assert no_status.status == 501


def test_patch_types(client):
    client.post(DEPLOYMENTS, make_deployment())
    path = f"{DEPLOYMENTS}/web"
    merged = client.patch(path, {"metadata": {"annotations": {"a": "1"}}})
    assert merged.body["metadata"]["annotations"] == {"a": "1"}
    json_patched = client.patch(path, [{"op": "replace", "path": "/spec/replicas", "value": 4}],
                                content_type="application/json-patch+json")
    assert json_patched.body["spec"]["replicas"] == 4
    strategic = client.patch(path, {"spec": {"template": {"spec": {"containers": [
        {"name": "main", "image": "nginx:2"}, {"name": "sidecar", "image": "busybox"}]}}}},
        content_type="application/strategic-merge-patch+json").body
    containers = strategic["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("main", "nginx:2"), ("sidecar", "busybox")]
    assert containers[0]["ports"][0]["containerPort"] == 80  # merged by name, not replaced
    deleted = client.patch(path, {"spec": {"template": {"spec": {"containers": [
        {"name": "sidecar", "$patch": "delete"}]}}}}, content_type="application/strategic-merge-patch+json").body
    assert [c["name"] for c in deleted["spec"]["template"]["spec"]["containers"]] == ["main"]
    apply = client.patch(path, "{}", content_type="application/apply-patch+yaml")
    assert apply.status == 415 and apply.body["kind"] == "Status"


def test_validation_of_builtins(client):
    nameless = make_deployment()
    del nameless["spec"]["template"]["spec"]["containers"][0]["name"]
    reply = client.post(DEPLOYMENTS, nameless)
    assert (reply.status, reply.reason) == (422, "Invalid")
    assert reply.body["details"]["causes"][0]["field"] == "spec.template.spec.containers[0].name"
    bad_name = client.post(CONFIGMAPS, make_configmap("Bad_Name"))
    assert bad_name.status == 422
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "1web"},
               "spec": {"ports": [{"port": 80}]}}
    reply = client.post("/api/v1/namespaces/default/services", service)  # DNS-1035: a letter first
    assert reply.status == 422 and "DNS-1035" in reply.body["details"]["causes"][0]["message"]
    service["metadata"]["name"] = "w" * 64
    reply = client.post("/api/v1/namespaces/default/services", service)
    assert reply.status == 422 and "no more than 63 characters" in reply.body["details"]["causes"][0]["message"]
    assert client.post(CONFIGMAPS, make_configmap("1cm")).status == 201  # a DNS-1123 subdomain may start so
    unknown = make_configmap("strict") | {"bogus": 1}
    assert client.post(CONFIGMAPS, unknown, params={"fieldValidation": "Strict"}).status == 400
    pruned = client.post(CONFIGMAPS, unknown)
    assert pruned.status == 201 and "bogus" not in pruned.body
    wrong_ns = client.post(CONFIGMAPS, make_configmap("x", namespace="other"))
    assert wrong_ns.status == 400
    assert client.post("/api/v1/namespaces/missing/configmaps", make_configmap()).status == 404


def test_not_implemented_and_unknown_resources(client):
    reply = client.get("/api/v1/namespaces/default/pods/p/log")
    assert (reply.status, reply.body["reason"]) == (501, "NotImplemented")
    assert client.get("/logs").status == 501
    assert client.get("/apis/nothing.example.com/v1/things").status == 404


def test_finalizers_defer_deletion(client):
    client.post(CONFIGMAPS, make_configmap(finalizers=["example.com/hold"]))
    deleting = client.delete(f"{CONFIGMAPS}/cm")
    assert deleting.status == 200 and deleting.body["metadata"]["deletionTimestamp"]
    assert client.get(f"{CONFIGMAPS}/cm").body["metadata"]["deletionTimestamp"]
    forbidden = client.patch(f"{CONFIGMAPS}/cm", {"metadata": {"finalizers": ["example.com/hold", "new"]}})
    assert forbidden.status == 422
    client.patch(f"{CONFIGMAPS}/cm", {"metadata": {"finalizers": None}})
    assert client.get(f"{CONFIGMAPS}/cm").status == 404


def test_owner_references_cascade(client):
    owner = client.post(DEPLOYMENTS, make_deployment()).body
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": owner["metadata"]["uid"]}
    client.post(CONFIGMAPS, make_configmap("child", ownerReferences=[ref]))
    client.post(CONFIGMAPS, make_configmap("held", ownerReferences=[ref], finalizers=["x/y"]))
    client.post(CONFIGMAPS, make_configmap("orphan"))
    client.delete(f"{DEPLOYMENTS}/web")
    assert client.get(f"{CONFIGMAPS}/child").status == 404
    assert client.get(f"{CONFIGMAPS}/held").body["metadata"]["deletionTimestamp"]
    assert client.get(f"{CONFIGMAPS}/orphan").status == 200
    owner = client.post(DEPLOYMENTS, make_deployment()).body
    ref["uid"] = owner["metadata"]["uid"]
    client.post(CONFIGMAPS, make_configmap("kept", ownerReferences=[ref]))
    client.delete(f"{DEPLOYMENTS}/web", {"propagationPolicy": "Orphan"})
    kept = client.get(f"{CONFIGMAPS}/kept").body
    assert "ownerReferences" not in kept["metadata"]


def test_a_blocking_owner_reference_asks_for_update_on_the_owners_finalizers(k8s, client):
    """As the OwnerReferencesPermissionEnforcement admission plugin authorizes it (OpenShift turns it on): an
    RBAC audit of the request log sees the permission such a write needs, once, when the reference is set."""
    owner = client.post(DEPLOYMENTS, make_deployment()).body
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": owner["metadata"]["uid"]}
    client.post(CONFIGMAPS, make_configmap("plain", ownerReferences=[ref]))
    client.post(CONFIGMAPS, make_configmap("child", ownerReferences=[{**ref, "blockOwnerDeletion": True}]))
    client.patch(f"{CONFIGMAPS}/child", {"data": {"k": "v"}})  # the reference is unchanged: no new check
    checks = k8s.requests(subresource="finalizers")
    assert [(r["verb"], r["group"], r["resource"], r["namespace"], r["name"]) for r in checks] == [
        ("update", "apps", "deployments", "default", "web")]


def test_selectors_and_cluster_wide_lists(client):
    client.post("/api/v1/namespaces", {"metadata": {"name": "other"}})
    client.post(CONFIGMAPS, make_configmap("a", labels={"tier": "web", "env": "prod"}))
    client.post(CONFIGMAPS, make_configmap("b", labels={"tier": "db"}))
    client.post("/api/v1/namespaces/other/configmaps", make_configmap("c", labels={"tier": "web"}))

    def names(path, **params):
        return sorted(o["metadata"]["name"] for o in client.get(path, params=params).body["items"])

    assert names(CONFIGMAPS, labelSelector="tier=web") == ["a"]
    assert names("/api/v1/configmaps", labelSelector="tier=web") == ["a", "c"]
    assert names("/api/v1/configmaps", labelSelector="tier in (web,db),!env") == ["b", "c"]
    assert names("/api/v1/configmaps", fieldSelector="metadata.name=b") == ["b"]
    assert names("/api/v1/configmaps", fieldSelector="metadata.namespace!=default") == ["c"]


def test_namespace_deletion_removes_its_objects(client):
    client.post("/api/v1/namespaces", {"metadata": {"name": "gone"}})
    client.post("/api/v1/namespaces/gone/configmaps", make_configmap())
    assert client.delete("/api/v1/namespaces/gone").status == 200
    assert client.get("/api/v1/namespaces/gone/configmaps/cm").status == 404


def test_write_log(k8s, client):
    client.post(DEPLOYMENTS, make_deployment())
    client.patch(f"{DEPLOYMENTS}/web/status", {"status": {"readyReplicas": 1}})
    client.get(f"{DEPLOYMENTS}/web")
    writes = k8s.writes(kind="Deployment")
    assert [(w["method"], w["name"], w["subresource"], w["status"]) for w in writes] == [
        ("POST", "web", None, 201), ("PATCH", "web", "status", 200)]
    assert writes[0]["user_agent"] == "emulator-test-client"
    assert len(client.get("/_emulator/writes").body) == 2
    client.delete("/_emulator/writes")
    assert k8s.writes() == []


def test_events_in_both_groups(client):
    event = {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "name": "p"}, "reason": "Test",
             "message": "hello", "type": "Normal"}
    assert client.post("/api/v1/namespaces/default/events", event).status == 201
    new_event = {"metadata": {"name": "e2"}, "reason": "Test", "note": "hi", "type": "Normal",
                 "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Act", "reportingController": "x/y",
                 "reportingInstance": "i"}
    assert client.post("/apis/events.k8s.io/v1/namespaces/default/events", new_event).status == 201


def test_table_output_for_builtins(client):
    client.post(DEPLOYMENTS, make_deployment())
    table = client.get(DEPLOYMENTS, accept="application/json;as=Table;v=v1;g=meta.k8s.io,application/json").body
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Ready", "Up-to-date", "Available", "Age"]
    assert table["rows"][0]["cells"][:2] == ["web", "0/2"]
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


def test_set_status_helper_and_paths(k8s):
    from k8s_emulator import path_for

    assert path_for("apps/v1", "deployments", "default", "web", "status") == f"{DEPLOYMENTS}/web/status"
    assert path_for("v1", "namespaces", name="x") == "/api/v1/namespaces/x"
    k8s.client().post(DEPLOYMENTS, make_deployment())
    obj = k8s.set_status("apps/v1", "deployments", "default", "web", {"readyReplicas": 2})
    assert obj["status"] == {"readyReplicas": 2}


def test_builtin_defaults(client):
    spec = client.post(DEPLOYMENTS, make_deployment()).body["spec"]
    assert spec["strategy"]["type"] == "RollingUpdate" and spec["revisionHistoryLimit"] == 10
    container = spec["template"]["spec"]["containers"][0]
    assert (container["imagePullPolicy"], container["ports"][0]["protocol"]) == ("IfNotPresent", "TCP")
    assert spec["template"]["spec"]["restartPolicy"] == "Always"
    secret = client.post("/api/v1/namespaces/default/secrets",
                         {"metadata": {"name": "s"}, "stringData": {"token": "abc"}}).body
    assert secret["data"] == {"token": "YWJj"} and "stringData" not in secret and secret["type"] == "Opaque"
    service = client.post("/api/v1/namespaces/default/services",
                          {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}}).body
    assert service["spec"]["clusterIP"].startswith("10.96.") and service["spec"]["ports"][0]["targetPort"] == 80
    replaced = client.put("/api/v1/namespaces/default/services/svc",
                          {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 81}]}}).body
    assert replaced["spec"]["clusterIP"] == service["spec"]["clusterIP"]


def test_in_process_api_matches_http(k8s):
    deployments = k8s.resource("apps/v1", "deployments")
    created = k8s.api.create(deployments, "default", make_deployment())
    assert k8s.client().get(f"{DEPLOYMENTS}/web").body["metadata"]["uid"] == created["metadata"]["uid"]
    with pytest.raises(ApiError) as failure:
        k8s.api.create(deployments, "default", make_deployment())
    assert failure.value.code == 409
    assert k8s.writes() == []  # the write log records HTTP requests only
