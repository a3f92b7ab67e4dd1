"""charts/pdpool: helm lint and helm template (Helm 4) for every value set; each object valid for Kubernetes
1.33 and 1.35; the CRD is the generated one; the operator's pod is restricted and probed; values are checked."""

from __future__ import annotations

import json
import os

import kubernetes_validate
import pytest
import yaml

from chart import CHART, NAMESPACE, ROOT, VALUE_SETS, StrictLoader, helm, one, render, template
from operator_examples import _selects
from pdpool.operator import crd
from pdpool.operator.main import defaulted_paths
from pdpool.operator.crd import schema_errors

BUILT_IN_API_GROUPS = ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1",
                       "apiextensions.k8s.io/v1")


def spec_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint(name):
    out = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *VALUE_SETS[name]).stdout
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("version", ["1.33", "1.35"])
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates(name, version):
    docs = render(*VALUE_SETS[name])
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        if doc["apiVersion"] in BUILT_IN_API_GROUPS:
            kubernetes_validate.validate(doc, version, strict=True)
        elif doc["kind"] == "InferencePool":  # our CRD's schema, as the API server applies it
            assert schema_errors(doc["spec"], spec_schema(), "spec") == []
        else:
            assert doc["kind"] == "PodMonitor", doc["kind"]  # checked in test_monitoring
    assert {"Deployment", "ServiceAccount", "ConfigMap", "Role", "RoleBinding"} <= kinds


def test_chart_crd_file_is_the_generated_one():
    assert (CHART / "files" / "inferencepools.pdpool.io.yaml").read_text() == crd.render_crd(), \
        "pdpool operator crd > charts/pdpool/files/inferencepools.pdpool.io.yaml"


def test_rendered_crd_is_the_generated_one_kept_on_uninstall():
    assert not (CHART / "crds").exists(), "Helm never upgrades crds/: the CRD is a template"
    rendered = one(render(), "CustomResourceDefinition")
    assert rendered["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert rendered == crd.build_crd()
    assert "CustomResourceDefinition" not in {d["kind"] for d in render(*VALUE_SETS["single-replica-crds-off"])}
    no_keep = one(render("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in no_keep["metadata"]


def test_operator_pod_is_restricted_probed_and_leader_elected():
    docs = render()
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/pdpool/pdpool-operator:0.1.0"  # the chart's appVersion
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], "a read-only root needs a writable /tmp"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert c["command"] == ["pdpool", "operator"]
    assert "--health-port=8080" in c["args"] and "--pool-defaults=/etc/pdpool/pool-defaults.yaml" in c["args"]
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}  # Lease identity and namespace
    assert dep["spec"]["replicas"] == 2
    pdb = one(docs, "PodDisruptionBudget")
    assert _selects(pdb["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    assert "PodDisruptionBudget" not in {d["kind"] for d in render("--set", "operator.replicas=1")}
    tagged = one(render("--set", "operator.image.tag=0.2.0"), "Deployment")
    assert tagged["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")


def lease_and_leader_role(release: str, *values: str) -> tuple[str, dict]:
    """(the operator's --lease-name, the leader Role) of one release rendered into NAMESPACE."""
    docs = [d for d in yaml.safe_load_all(helm("template", release, str(CHART), "--namespace", NAMESPACE,
                                               *values).stdout) if d]
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    (lease,) = [a.split("=", 1)[1] for a in args if a.startswith("--lease-name=")]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == NAMESPACE]
    return lease, role


def test_two_releases_in_one_namespace_elect_through_their_own_leases():
    """Before, every release's operators took the Lease "pdpool-operator": a second release in the namespace never
    led (or, leading, paused the first). The name follows the full name; only the Lease's get/update is named."""
    (a, role_a), (b, role_b) = lease_and_leader_role("a"), lease_and_leader_role("b")
    assert (a, b) == ("a-pdpool-operator", "b-pdpool-operator")
    assert role_a["metadata"]["name"] != role_b["metadata"]["name"]
    for lease, role in ((a, role_a), (b, role_b)):
        named = [r for r in role["rules"] if r.get("resourceNames")]
        assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                          "resourceNames": [lease], "verbs": ["get", "update"]}]
    # the documented release name keeps its Lease (an upgrade does not elect a second leader); overrides follow
    assert lease_and_leader_role("pdpool")[0] == "pdpool-operator"
    assert lease_and_leader_role("r", "--set", "fullnameOverride=ops")[0] == "ops-operator"
    assert lease_and_leader_role("r", "--set", "operator.leaseName=shared.lease")[0] == "shared.lease"
    bad = helm("template", "r", str(CHART), "--set", "operator.leaseName=Bad_Lease", check=False)
    assert bad.returncode != 0 and "leaseName" in bad.stderr, bad.stderr


def test_cluster_wide_rbac_by_default():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render()}
    assert ("ClusterRole", "pdpool") in kinds and ("ClusterRoleBinding", "pdpool") in kinds


def test_namespaced_mode_has_no_cluster_scoped_rbac():
    docs = render(*VALUE_SETS["namespaced"])
    cluster_scoped = {d["kind"] for d in docs if "namespace" not in d["metadata"]}
    assert cluster_scoped == {"CustomResourceDefinition"}, "only the CRD, which the installer applies"
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["batch", NAMESPACE, "serving"]
    assert [r["metadata"]["name"] for r in roles if r["metadata"]["namespace"] == NAMESPACE] == ["pdpool-leader"]
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=serving" in args and "--namespace=batch" in args
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdpool", "namespace": NAMESPACE}]
    assert not any(d["kind"] == "CustomResourceDefinition" for d in render(
        *VALUE_SETS["namespaced"], "--set", "crds.install=false"))


def test_example_pool_is_the_cpu_demo_example():
    pool = one(render(*VALUE_SETS["example-pool"]), "InferencePool")
    example = yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())
    assert pool["spec"] == {**example["spec"], "image": "ghcr.io/pdpool/pdpool:0.1.0"}
    assert pool["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert pool["metadata"]["namespace"] == NAMESPACE
    over = one(render("--set", "examplePool.enabled=true", "--set", "examplePool.spec.router.service.type=NodePort",
                      "--set", "examplePool.spec.decode.replicas=2"), "InferencePool")
    assert over["spec"]["router"] == {"service": {"type": "NodePort"}} and over["spec"]["decode"]["replicas"] == 2
    assert over["spec"]["decode"]["resources"] == example["spec"]["decode"]["resources"]


def test_example_pool_outside_the_watched_namespaces_is_refused():
    out = helm("template", "r", str(CHART), "--set", "examplePool.enabled=true", "--set", "watchNamespaces={a}",
               check=False)
    assert out.returncode != 0 and "not in watchNamespaces" in out.stderr


def pool_defaults(docs: list[dict]) -> dict:
    cm = one(docs, "ConfigMap", "pdpool-pool-defaults")
    return yaml.safe_load(cm["data"]["pool-defaults.yaml"])


def test_rdma_values_become_pool_defaults_the_operator_accepts():
    docs = render(*VALUE_SETS["rdma"])
    defaults = pool_defaults(docs)
    assert defaults == {
        "kvTransfer": {"rdma": {"ipcLock": True}, "shmSize": "16Gi", "ucxTls": "rc,cuda_copy,cuda_ipc",
                       "ucxNetDevices": "mlx5_0:1"},
        "prefill": {"resources": {"limits": {"rdma/ib": 1}}},
        "decode": {"resources": {"limits": {"rdma/ib": 1}}},
        "placement": {"topologyKey": "nvidia.com/gpu.clique", "mode": "required"}}
    assert schema_errors(defaults, spec_schema(), "poolDefaults") == []
    assert defaulted_paths(defaults, spec_schema(), "poolDefaults") == [], "a CRD default would beat it"
    assert pool_defaults(render()) == {}
    # poolDefaults win over the derived values, and restarting the operator follows a change of them
    mixed = render(*VALUE_SETS["rdma"], "--set", "poolDefaults.kvTransfer.ucxTls=rc\\,tcp")
    assert pool_defaults(mixed)["kvTransfer"]["ucxTls"] == "rc,tcp"
    hashes = {one(d, "Deployment")["spec"]["template"]["metadata"]["annotations"]["pdpool.io/pool-defaults-hash"]
              for d in (docs, mixed, render())}
    assert len(hashes) == 3


def test_pool_image_pull_secrets_pass_through_pool_defaults_and_the_example_pool():
    """A private registry: poolDefaults gives every pool its pull secrets (each pool's namespace needs the Secret);
    examplePool.spec sets them on the demo pool; both are checked as the CRD checks them."""
    secrets = '[{"name": "ghcr-pull"}]'
    docs = render("--set-json", f"poolDefaults.imagePullSecrets={secrets}", "--set", "examplePool.enabled=true",
                  "--set-json", f"examplePool.spec.imagePullSecrets={secrets}")
    defaults = pool_defaults(docs)
    assert defaults == {"imagePullSecrets": [{"name": "ghcr-pull"}]}
    assert schema_errors(defaults, spec_schema(), "poolDefaults") == []
    assert defaulted_paths(defaults, spec_schema(), "poolDefaults") == []
    pool = one(docs, "InferencePool")
    assert pool["spec"]["imagePullSecrets"] == [{"name": "ghcr-pull"}]
    assert schema_errors(pool["spec"], spec_schema(), "spec") == []
    typo = helm("template", "r", str(CHART), "--set-json", 'poolDefaults.imagePullSecrets=[{"nmae": "x"}]',
                check=False)
    assert typo.returncode != 0 and "nmae" in typo.stderr, typo.stderr


def test_example_pool_cors_reaches_its_router_args():
    """examplePool.spec.cors is checked as the CRD checks it and becomes the router's (and nodes') CORS flags."""
    from operator_examples import make_body
    from pdpool import config
    from pdpool.operator.builders.router import router_config
    from pdpool.operator.spec import parse_pool

    docs = render("--set", "examplePool.enabled=true", "--set-json",
                  'examplePool.spec.cors={"allowedOrigins": ["https://app.example"], "allowCredentials": true}')
    pool = one(docs, "InferencePool")
    assert pool["spec"]["cors"] == {"allowedOrigins": ["https://app.example"], "allowCredentials": True}
    assert schema_errors(pool["spec"], spec_schema(), "spec") == []
    argv = config.to_argv(router_config(parse_pool(make_body(pool["spec"]))), config.RouterCommandConfig)
    assert argv[argv.index("--allowed-origins"):][:3] == ["--allowed-origins", "https://app.example",
                                                           "--allow-credentials"]


def test_monitoring():
    docs = render(*VALUE_SETS["monitoring"])
    operator_pod = one(docs, "Deployment")["spec"]["template"]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"pdpool-operator", "pdpool-pools"}
    op = monitors["pdpool-operator"]["spec"]
    assert _selects(op["selector"], operator_pod["metadata"]["labels"])
    assert op["podMetricsEndpoints"][0]["port"] in {p["name"] for p in operator_pod["spec"]["containers"][0]["ports"]}
    # the pools' monitor selects exactly the routers and nodes the operator renders, on their "http" port
    from operator_examples import example_body
    from pdpool.operator import builders
    from pdpool.operator.spec import parse_pool

    pools = monitors["pdpool-pools"]["spec"]
    assert pools["namespaceSelector"] == {"any": True}
    for child in builders.render(parse_pool(example_body("cpu-demo")), token=lambda: "t"):
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert _selects(pools["selector"], pod["metadata"]["labels"]) == (component != "redis"), component
        if component != "redis":
            assert "http" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    for monitor in monitors.values():
        assert set(monitor["spec"]) <= {"selector", "namespaceSelector", "podMetricsEndpoints"}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "relabelings"} and endpoint["path"] == "/metrics"
    # the scrapers reach the operator's health port, and the nodes' HTTP port through the pool defaults
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    policy = one(docs, "NetworkPolicy")["spec"]
    assert policy["ingress"] == [{"from": [peer], "ports": [{"protocol": "TCP", "port": 8080}]}]
    assert pool_defaults(docs) == {"networkPolicy": {"scrapeFrom": [peer]}}
    ns_docs = render(*VALUE_SETS["monitoring"], *VALUE_SETS["namespaced"])
    assert one(ns_docs, "PodMonitor", "pdpool-pools")["spec"]["namespaceSelector"] == {"matchNames": ["serving",
                                                                                                      "batch"]}


def test_scrapers_reach_the_operator_and_the_nodes_without_the_chart_s_pod_monitors():
    """monitoring.scrapeFrom is where the scrapers are, whoever configures them (a Prometheus of one's own, other
    monitors): before, with podMonitors off, the operator's policy admitted them and every pool's kept them out."""
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render("--set-json", f"monitoring.scrapeFrom={json.dumps([peer])}")
    assert "PodMonitor" not in {d["kind"] for d in docs}
    assert one(docs, "NetworkPolicy")["spec"]["ingress"][0]["from"] == [peer]
    assert pool_defaults(docs) == {"networkPolicy": {"scrapeFrom": [peer]}}


def test_dashboard_configmap_embeds_the_dashboard_file():
    path = CHART / "files" / "grafana-dashboard.json"
    if not path.exists():  # (written by the dashboard's owner) the chart still renders, and says so
        assert "ConfigMap/pdpool-dashboard" not in {f"{d['kind']}/{d['metadata']['name']}"
                                                    for d in render(*VALUE_SETS["monitoring"])}
        out = helm("install", "pdpool", str(CHART), "--dry-run=client", *VALUE_SETS["monitoring"]).stdout
        assert "no files/grafana-dashboard.json" in out
        return
    cm = one(render(*VALUE_SETS["monitoring"]), "ConfigMap", "pdpool-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdpool.json"]) == json.loads(path.read_text())


def test_operator_network_policy_admits_nothing_without_scrapers():
    policy = one(render(), "NetworkPolicy")["spec"]
    assert policy["ingress"] == [] and policy["policyTypes"] == ["Ingress"]
    assert "NetworkPolicy" not in {d["kind"] for d in render("--set", "networkPolicy.enabled=false")}


@pytest.mark.parametrize("values, name", [
    (["--set", "nameOverride=serving"], "pdpool-serving"),
    (["--set", "fullnameOverride=ops"], "ops"),
    (["--set", "nameOverride=serving", "--set", "fullnameOverride=ops"], "ops"),
])
def test_name_overrides_rename_every_object_and_its_references(values, name):
    """The usual chart values (before, values.schema.json refused them); the references follow the names."""
    docs = render(*values)
    for doc in docs:
        if doc["apiVersion"] in BUILT_IN_API_GROUPS and doc["kind"] != "CustomResourceDefinition":
            kubernetes_validate.validate(doc, "1.35", strict=True)
            assert doc["metadata"]["name"].startswith(name), doc["metadata"]["name"]
    pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and one(docs, "ServiceAccount", name)
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {f"{name}-pool-defaults"}
    assert one(docs, "ConfigMap", f"{name}-pool-defaults")
    binding = one(docs, "ClusterRoleBinding", name)
    assert binding["roleRef"]["name"] == name and binding["subjects"][0]["name"] == name
    assert one(docs, "RoleBinding", f"{name}-leader")["subjects"][0]["name"] == name


@pytest.mark.parametrize("values, message", [
    (["--set", "operater.replicas=1"], "additional properties 'operater' not allowed"),
    (["--set", "operator.replicas=two"], "got string, want integer"),
    (["--set", "operator.replicas=0"], "minimum"),
    (["--set", "rdma.placement=sometimes"], "placement"),
    (["--set", "rdma.shmSize=lots"], "shmSize"),
    (["--set", "monitoring.podMonitors.intervall=30s"], "additional properties 'intervall' not allowed"),
    (["--set", "watchNamespaces=serving"], "want array"),
    (["--set", "watchNamespaces={Serving}"], "watchNamespaces"),
    (["--set", "examplePool.enabeld=true"], "additional properties 'enabeld' not allowed"),
    (["--set", "crds.install=yes"], "want boolean"),
    (["--set", "operator.image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "examplePool.name=7b"], "examplePool/name"),  # the CRD's name rule: a DNS-1035 label
    (["--set", "examplePool.name=" + "p" * 56], "examplePool/name"),
    (["--set", "nameOverride=Ops"], "nameOverride"),
    (["--set", "operator.leaseSeconds=0"], "leaseSeconds': exclusiveMinimum"),
    (["--set", "operator.statusInterval=5s"], "/operator/statusInterval"),
])
def test_values_schema_rejects_typos_and_wrong_types(values, message):
    out = helm("template", "r", str(CHART), *values, check=False)
    assert out.returncode != 0, f"{values} was accepted"
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize("flag, value", [("--set", "7.5"), ("--set", "0.5"), ("--set-json", "7.5"), ("--set", "20")])
def test_operator_seconds_take_a_fraction_from_set(flag, value):
    """helm --set passes 7.5 as the string "7.5" (it parses integers and booleans only): the schema refused
    `--set operator.leaseSeconds=7.5` ("got string, want number"), so a fraction needed --set-json or a file."""
    docs = render(flag, f"operator.leaseSeconds={value}", flag, f"operator.statusInterval={value}")
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--lease-seconds={value}" in args and f"--status-interval={value}" in args
    from pdpool.operator.main import parser
    assert parser().parse_args(args[:4]).lease_seconds == float(value)


def test_values_schema_embeds_the_crd_spec_schema():
    """poolDefaults and examplePool.spec are checked at `helm install` as the API server would (unknown fields
    too, which it would prune silently); poolDefaults admits only fields without a CRD default."""
    path = CHART / "values.schema.json"
    values_schema = json.loads(path.read_text())
    want = {"poolDefaults": {**crd.strict_spec_schema(settable_by_default=True), "description":
                             "Partial InferencePool spec applied under every pool: fields without a CRD default."},
            "examplePool.spec": {**crd.strict_spec_schema(), "description":
                                 "Spec fields merged over the demo spec."}}
    got = {"poolDefaults": values_schema["properties"]["poolDefaults"],
           "examplePool.spec": values_schema["properties"]["examplePool"]["properties"]["spec"]}
    if os.environ.get("PDPOOL_REGEN_CHART") == "1":
        values_schema["properties"]["poolDefaults"] = want["poolDefaults"]
        values_schema["properties"]["examplePool"]["properties"]["spec"] = want["examplePool.spec"]
        path.write_text(json.dumps(values_schema, indent=2) + "\n")
        got = want
    assert got == want, "the CRD changed: PDPOOL_REGEN_CHART=1 pytest tests/helm/test_chart_render.py"


@pytest.mark.parametrize("values, message", [
    (["--set", "poolDefaults.kvTransfer.ucxTsl=rc"], "additional properties 'ucxTsl' not allowed"),
    (["--set", "poolDefaults.kvTransfer.failurePolicy=fail"], "additional properties 'failurePolicy' not allowed"),
    (["--set", "poolDefaults.placement.mode=sometimes"], "mode"),
    (["--set", "examplePool.spec.engine.maxNumSeqs=0"], "maxNumSeqs"),
    (["--set", "examplePool.spec.router.servce.type=NodePort"], "additional properties 'servce' not allowed"),
    (["--set", "examplePool.spec.cors.allowedOrigins=https://app.example"], "allowedOrigins"),
    (["--set-json", 'poolDefaults.cors.allowedOrigins=["https://app.example"]'],  # a CRD default would beat it
     "additional properties 'allowedOrigins' not allowed"),
])
def test_pool_values_are_checked_against_the_crd(values, message):
    out = helm("template", "r", str(CHART), *values, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_every_value_is_documented_inline():
    """Each key of values.yaml has a comment on the line(s) before it, or a trailing comment, or belongs to a
    mapping whose comment documents it (one level of leaf keys under a commented parent)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped or stripped.startswith("-"):
            continue
        indent = len(line) - len(stripped)
        prev = lines[i - 1].strip() if i else ""
        documented = "#" in line or prev.startswith("#")
        if not documented:  # a leaf of a commented parent mapping (e.g. resources.requests, image.pullPolicy)
            for j in range(i - 1, -1, -1):
                above = lines[j]
                if above.strip() and len(above) - len(above.lstrip()) < indent:
                    documented = j > 0 and lines[j - 1].strip().startswith("#") or "#" in above
                    break
        if not documented:
            undocumented.append(stripped)
    assert undocumented == []


def test_notes_tell_how_to_create_a_pool_and_reach_it():
    out = helm("install", "pdpool", str(CHART), "--dry-run=client", "--namespace", NAMESPACE).stdout
    notes = out[out.index("NOTES:"):]
    assert "kind: InferencePool" in notes and "port-forward svc/demo 8000:80" in notes
    assert "/v1/chat/completions" in notes
    assert "every namespace" in notes
    crds_off = helm("install", "pdpool", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                    "--set", "crds.install=false").stdout
    assert "kubectl apply --server-side" in crds_off


def test_template_is_deterministic():
    assert template(*VALUE_SETS["rdma"]) == template(*VALUE_SETS["rdma"])


EVERY_FEATURE = ["--set", "examplePool.enabled=true", "--set", "monitoring.podMonitors.enabled=true",
                 "--set", "monitoring.dashboard.enabled=true", "--set", "rdma.enabled=true"]


def value_paths() -> list[tuple[str, ...]]:
    """Every key of values.yaml down to the chart's own sections: not inside what goes to Kubernetes as is
    (resources, securityContext: a map the schema leaves open) or the partial pool specs (the CRD's schema)."""
    paths = []

    def walk(tree: dict, schema: dict, above: tuple[str, ...]) -> None:
        for key, value in tree.items():
            paths.append((*above, key))
            sub = schema["properties"][key]
            if isinstance(value, dict) and "properties" in sub and key not in ("poolDefaults", "spec"):
                walk(value, sub, (*above, key))

    walk(yaml.safe_load((CHART / "values.yaml").read_text()),
         json.loads((CHART / "values.schema.json").read_text()), ())
    return paths


def required_by_schema(path: tuple[str, ...]) -> bool:
    node = json.loads((CHART / "values.schema.json").read_text())
    for key in path[:-1]:
        node = node["properties"][key]
    return path[-1] in node.get("required", [])


def with_null(path: tuple[str, ...]) -> dict:
    """Every feature on (as EVERY_FEATURE), and ``path`` null, as `key:` with nothing after it writes it."""
    values = {"examplePool": {"enabled": True}, "monitoring": {"podMonitors": {"enabled": True},
                                                               "dashboard": {"enabled": True}},
              "rdma": {"enabled": True}}
    tree = values
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = None
    return values


def test_a_value_left_empty_is_refused_by_name_or_renders_valid_objects(tmp_path):
    """`key:` with nothing after it (a section whose lines were all commented out) is null, and Helm then drops
    the chart's default. A value the templates need is refused by the schema, naming it; any other renders as
    "none". Before, `poolDefaults:` failed with "error calling deepCopy: reflect: call of reflect.Value.Type on
    zero Value", a null section with "Use --debug flag to render out invalid YAML", and `operator.leaseSeconds:`
    rendered an operator that exits on `--lease-seconds=`."""
    default = {json.dumps(d, sort_keys=True) for d in render(*EVERY_FEATURE)}
    for path in value_paths():
        key = ".".join(path)
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(with_null(path)))
        out = helm("template", "r", str(CHART), "-f", str(values), check=False)
        if required_by_schema(path):
            assert out.returncode != 0 and f"missing property '{path[-1]}'" in out.stderr, (key, out.stderr)
            continue
        assert out.returncode == 0, (key, out.stderr)
        docs = [d for d in yaml.load_all(out.stdout, Loader=StrictLoader) if d]
        for doc in docs:
            if json.dumps(doc, sort_keys=True) in default:
                continue
            if doc["apiVersion"] in BUILT_IN_API_GROUPS:
                kubernetes_validate.validate(doc, "1.35", strict=True)
            elif doc["kind"] == "InferencePool":
                assert schema_errors(doc["spec"], spec_schema(), "spec") == [], key
        args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert not [a for a in args if a.endswith("=")], (key, args)


@pytest.mark.parametrize("key", ["poolDefaults", "examplePool.spec"])
def test_an_empty_partial_pool_spec_is_no_spec(key):
    assert template(*EVERY_FEATURE, "--set-json", f"{key}=null") == template(*EVERY_FEATURE, "--set-json",
                                                                             f"{key}={{}}")


def test_extra_labels_and_annotations_replace_the_charts_own_but_never_the_selector():
    """operator.podLabels, podAnnotations and the monitoring labels may name a key the chart sets too. Before,
    the key came out twice in one mapping, which `helm install` refuses ("mapping key already defined"); and
    last-wins, app.kubernetes.io/name would have left the pods outside their Deployment's selector."""
    docs = render("--set", "monitoring.podMonitors.enabled=true", "--set", "monitoring.dashboard.enabled=true",
                  "--set-json", 'operator.podLabels={"app.kubernetes.io/name": "mine", '
                                '"app.kubernetes.io/version": "v9", "team": "serving"}',
                  "--set-json", 'operator.podAnnotations={"pdpool.io/pool-defaults-hash": "x", "a": "b"}',
                  "--set-json", 'monitoring.podMonitors.labels={"app.kubernetes.io/part-of": "obs"}',
                  "--set-json", 'monitoring.dashboard.labels={"helm.sh/chart": "d", "grafana_dashboard": "1"}')
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["metadata"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["labels"].items()
    assert pod["labels"]["app.kubernetes.io/version"] == "v9" and pod["labels"]["team"] == "serving"
    assert pod["annotations"]["a"] == "b" and pod["annotations"]["pdpool.io/pool-defaults-hash"] != "x"
    assert one(docs, "PodMonitor", "pdpool-operator")["metadata"]["labels"]["app.kubernetes.io/part-of"] == "obs"
    assert one(docs, "ConfigMap", "pdpool-dashboard")["metadata"]["labels"]["helm.sh/chart"] == "d"
    for doc in docs:
        if doc["apiVersion"] in BUILT_IN_API_GROUPS:
            kubernetes_validate.validate(doc, "1.35", strict=True)
