"""CustomResourceDefinitions: serving, discovery, validation, defaults, pruning, status, tables."""

import pytest
from emulator_builders import CRDS, WIDGETS, make_widget, make_widget_crd


@pytest.fixture
def client(k8s):
    client = k8s.client()
    assert client.post(CRDS, make_widget_crd()).status == 201
    return client


def test_crd_is_established_and_discoverable(client):
    crd = client.get(f"{CRDS}/widgets.example.com").body
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    groups = client.get("/apis").body["groups"]
    assert any(g["name"] == "example.com" for g in groups)
    resources = {r["name"]: r for r in client.get("/apis/example.com/v1").body["resources"]}
    assert resources["widgets"]["kind"] == "Widget" and resources["widgets"]["shortNames"] == ["wd"]
    assert "widgets/status" in resources
    aggregated = client.get("/apis", accept="application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList")
    assert aggregated.body["kind"] == "APIGroupDiscoveryList"
    group = next(g for g in aggregated.body["items"] if g["metadata"]["name"] == "example.com")
    widgets = group["versions"][0]["resources"][0]
    assert (widgets["resource"], widgets["scope"], widgets["subresources"][0]["subresource"]) == (
        "widgets", "Namespaced", "status")
    openapi = client.get("/openapi/v3").body["paths"]
    doc = client.get(openapi["apis/example.com/v1"]["serverRelativeURL"].split("?")[0]).body
    assert "com.example.v1.Widget" in doc["components"]["schemas"]


def test_bad_crd_is_invalid(k8s):
    crd = make_widget_crd()
    crd["metadata"]["name"] = "wrong.example.com"
    reply = k8s.client().post(CRDS, crd)
    assert (reply.status, reply.reason) == (422, "Invalid")


def test_defaults_and_pruning(client):
    created = client.post(WIDGETS, make_widget(extra={"free": [1]}, labels={"a": "b"}) | {"junk": 1})
    assert created.status == 201
    spec = created.body["spec"]
    assert spec == {"model": "tiny", "replicas": 1, "mode": "fast", "extra": {"free": [1]}, "labels": {"a": "b"}}
    assert "junk" not in created.body
    strict = client.post(WIDGETS, make_widget("w2", bogus=True), params={"fieldValidation": "Strict"})
    assert strict.status == 400 and 'unknown field "spec.bogus"' in strict.body["message"]


def test_validation_causes(client):
    reply = client.post(WIDGETS, make_widget(model="Bad_Model", replicas=11, mode="turbo"))
    assert (reply.status, reply.reason) == (422, "Invalid")
    causes = {c["field"]: c["reason"] for c in reply.body["details"]["causes"]}
    assert causes == {"spec.model": "FieldValueInvalid", "spec.replicas": "FieldValueInvalid",
                      "spec.mode": "FieldValueNotSupported"}
    missing = client.post(WIDGETS, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "m"},
                                    "spec": {}})
    assert missing.body["details"]["causes"] == [
        {"reason": "FieldValueRequired", "field": "spec.model", "message": "Required value"}]
    wrong_type = client.post(WIDGETS, make_widget(replicas="three"))
    assert wrong_type.status == 422 and wrong_type.body["details"]["causes"][0]["reason"] == "FieldValueTypeInvalid"
    client.post(WIDGETS, make_widget(size="4Gi"))
    bad_update = client.patch(f"{WIDGETS}/w1", {"spec": {"replicas": -1}})
    assert bad_update.status == 422
    assert client.patch(f"{WIDGETS}/w1", {"spec": {"size": 2}}).status == 200
    bad_size = client.patch(f"{WIDGETS}/w1", {"spec": {"size": "lots"}})
    assert bad_size.status == 422 and bad_size.body["details"]["causes"][0]["field"] == "spec.size"


def test_a_crd_may_restrict_the_name(k8s):
    """Structural schemas may restrict metadata.name (and generateName); the API server validates the name."""
    crd = make_widget_crd()
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"] = {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8, "pattern": "^[a-z]"}}}
    client = k8s.client()
    assert client.post(CRDS, crd).status == 201
    assert client.post(WIDGETS, make_widget("w12345678")).body["details"]["causes"] == [
        {"reason": "FieldValueTooLong", "field": "metadata.name", "message": "Too long: may not be more than 8 bytes"}]
    (cause,) = client.post(WIDGETS, make_widget("1w")).body["details"]["causes"]
    assert cause["field"] == "metadata.name" and "should match '^[a-z]'" in cause["message"]
    generated = make_widget()
    generated["metadata"] = {"generateName": "widget-"}  # widget-xxxxx: 12 characters
    assert client.post(WIDGETS, generated).status == 422
    assert client.post(WIDGETS, make_widget("w1")).status == 201


def test_status_subresource_and_generation(client):
    client.post(WIDGETS, make_widget() | {"status": {"phase": "Ignored"}})
    obj = client.get(f"{WIDGETS}/w1").body
    assert "status" not in obj and obj["metadata"]["generation"] == 1
    status = client.patch(f"{WIDGETS}/w1/status", {"status": {"phase": "Ready"}, "spec": {"replicas": 5}}).body
    assert status["status"] == {"phase": "Ready"} and status["spec"]["replicas"] == 1
    assert status["metadata"]["generation"] == 1
    spec = client.patch(f"{WIDGETS}/w1", {"spec": {"replicas": 2}, "status": {"phase": "Nope"}}).body
    assert spec["metadata"]["generation"] == 2 and spec["status"] == {"phase": "Ready"}
    bad_status = client.patch(f"{WIDGETS}/w1/status", {"status": {"phase": 3}})
    assert bad_status.status == 422


def test_without_status_subresource_status_is_part_of_the_object(k8s):
    client = k8s.client()
    client.post(CRDS, make_widget_crd(status_subresource=False))
    client.post(WIDGETS, make_widget() | {"status": {"phase": "Set"}})
    assert client.get(f"{WIDGETS}/w1").body["status"] == {"phase": "Set"}
    assert client.patch(f"{WIDGETS}/w1/status", {"status": {}}).status == 501


def test_updates_of_custom_resources_need_a_resource_version(client):
    created = client.post(WIDGETS, make_widget()).body
    unconditional = make_widget(replicas=2)
    reply = client.put(f"{WIDGETS}/w1", unconditional)
    assert reply.status == 422 and reply.body["details"]["causes"][0]["field"] == "metadata.resourceVersion"
    unconditional["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    assert client.put(f"{WIDGETS}/w1", unconditional).status == 200
    assert client.post(WIDGETS, make_widget("w2") | {"metadata": {"name": "w2", "resourceVersion": "5"}}).status == 400


def test_strategic_merge_patch_is_unsupported_for_custom_resources(client):
    client.post(WIDGETS, make_widget())
    reply = client.patch(f"{WIDGETS}/w1", {"spec": {"replicas": 2}},
                         content_type="application/strategic-merge-patch+json")
    assert (reply.status, reply.body["reason"]) == (415, "UnsupportedMediaType")
    json_patch = client.patch(f"{WIDGETS}/w1", [{"op": "add", "path": "/spec/replicas", "value": 3}],
                              content_type="application/json-patch+json")
    assert json_patch.body["spec"]["replicas"] == 3


def test_table_uses_printer_columns(client):
    client.post(WIDGETS, make_widget())
    client.patch(f"{WIDGETS}/w1/status", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    table = client.get(WIDGETS, accept="application/json;as=Table;v=v1;g=meta.k8s.io").body
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Model", "Replicas", "Ready"]
    assert table["rows"][0]["cells"] == ["w1", "tiny", 1, "True"]


def test_scale_subresource(client):
    client.post(WIDGETS, make_widget(replicas=2))
    scale = client.get(f"{WIDGETS}/w1/scale").body
    assert (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 2)
    scaled = client.patch(f"{WIDGETS}/w1/scale", {"spec": {"replicas": 5}})
    assert scaled.status == 200 and scaled.body["spec"]["replicas"] == 5
    obj = client.get(f"{WIDGETS}/w1").body
    assert obj["spec"]["replicas"] == 5 and obj["metadata"]["generation"] == 2
    assert client.patch(f"{WIDGETS}/w1/scale", {"spec": {"replicas": -1}}).status == 422
    stale = scale | {"spec": {"replicas": 1}}
    assert client.put(f"{WIDGETS}/w1/scale", stale).status == 409


def test_deleting_the_crd_removes_its_objects(client):
    client.post(WIDGETS, make_widget())
    assert client.delete(f"{CRDS}/widgets.example.com").status == 200
    assert client.get(WIDGETS).status == 404
    client.post(CRDS, make_widget_crd())
    assert client.get(WIDGETS).body["items"] == []


def test_finalizers_on_custom_resources(client):
    client.post(WIDGETS, make_widget() | {"metadata": {"name": "w1", "finalizers": ["example.com/cleanup"]}})
    deleting = client.delete(f"{WIDGETS}/w1").body
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["generation"] == 2
    client.patch(f"{WIDGETS}/w1", [{"op": "remove", "path": "/metadata/finalizers"}],
                 content_type="application/json-patch+json")
    assert client.get(f"{WIDGETS}/w1").status == 404
