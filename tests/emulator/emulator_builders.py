"""Object builders shared by the emulator's tests."""

DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
WIDGETS = "/apis/example.com/v1/namespaces/default/widgets"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def make_deployment(name="web", replicas=2, image="nginx:1.27", labels=None, **meta):
    labels = labels or {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, **meta},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [{"name": "main", "image": image,
                                                       "ports": [{"name": "http", "containerPort": 80}]}]}}},
    }


def make_configmap(name="cm", data=None, **meta):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": data or {"k": "v"}}


def make_widget_crd(status_subresource=True):
    version = {
        "name": "v1", "served": True, "storage": True,
        "additionalPrinterColumns": [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        ],
        "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {
                "spec": {"type": "object", "required": ["model"], "properties": {
                    "model": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                    "replicas": {"type": "integer", "minimum": 0, "maximum": 10, "default": 1},
                    "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "size": {"x-kubernetes-int-or-string": True,
                             "anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[0-9]+Gi$"}]},
                }},
                "status": {"type": "object", "properties": {
                    "phase": {"type": "string"},
                    "conditions": {"type": "array", "items": {"type": "object", "properties": {
                        "type": {"type": "string"}, "status": {"type": "string"}}}},
                }},
            },
        }},
    }
    if status_subresource:
        version["subresources"] = {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                           "statusReplicasPath": ".status.replicas"}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
                 "versions": [version]},
    }


def make_widget(name="w1", **spec):
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": {"model": "tiny", **spec}}
