"""An in-memory Kubernetes API server for tests: envtest-like, API semantics only, no controllers.

    with Emulator() as k8s:                      # aiohttp on 127.0.0.1:<free port>, in a thread
        k8s.url                                  # for a kubeconfig (k8s_tools.write_kubeconfig)
        k8s.client().post(path, body)            # blocking HTTP client → Reply(status, body)
        k8s.set_status("apps/v1", "deployments", "default", "web", {"readyReplicas": 1})
        k8s.api.get(k8s.resource("apps/v1", "deployments"), "default", "web")   # in-process
        k8s.writes(resource="deployments", method="PATCH"); k8s.clear_writes()
        k8s.requests(verb="watch")               # every resource request with its RBAC verb (for RBAC audits)
        # over HTTP: GET /_emulator/writes, DELETE /_emulator/writes

Modules, one role each: routing (paths), resources (served types), store (objects, versions,
watch fan-out, write log), api (CRUD semantics), garbage (owner references, cascades),
admission + schemas (prune, default, validate), defaults (built-in server defaults),
patching (merge, JSON, strategic), scale, crds, discovery (legacy and aggregated v2),
openapi (v3), tables, watching, handlers (resources), endpoints (cluster-level), server, client.

Limitations (documented behaviour the emulator does not model):
- no controllers: nothing creates Pods/ReplicaSets, and Deployment status is what tests set;
- garbage collection is synchronous; Foreground propagation behaves like Background;
- deleting a namespace deletes its objects at once (no Terminating phase);
- lists ignore `limit`/`continue` and `resourceVersion`/`resourceVersionMatch` (always the latest);
- multi-version CRDs share one stored object with no conversion (apiVersion is rewritten);
- core/v1 and events.k8s.io/v1 Events are stored separately;
- subresources: status and scale only; log/exec/attach/port-forward/eviction answer 501
  (so `kubectl logs deploy/x` waits for a Pod that never comes);
- no server-side apply (415; Helm 4 installs use it), no managedFields, no admission webhooks, no CEL
  (`x-kubernetes-validations`), no RBAC/authentication, no protobuf, no /openapi/v2 (404);
- built-in validation is the published JSON schema (types, required, unknown fields),
  not the API server's per-kind Go validation.
"""

from .client import Client, Reply
from .errors import ApiError
from .routing import path_for
from .server import Emulator

__all__ = ["ApiError", "Client", "Emulator", "Reply", "path_for"]
