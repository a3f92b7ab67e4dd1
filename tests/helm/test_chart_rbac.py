"""RBAC from the code: run the operator's end-to-end suite against the API emulator, record every request the
operator makes (verb, group, resource, namespace), and compare with the chart's rules. A call no rule allows
fails; a rule no call uses fails, except what the operator must hold only to grant it (RBAC's escalation check:
the router's EndpointSlice Role, ``DISCOVERY_RULES``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chart import NAMESPACE, ROOT, VALUE_SETS, render
from k8s_fixtures import MODULE_REQUESTS
from pdpool.operator.builders.router import DISCOVERY_RULES

OPERATOR_AGENTS = ("pdpool-operator", "kopf/")  # the operator's own client, and kopf's
E2E_MODULE = "test_operator_e2e"


def triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(verb, group, resource) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def called(requests: list[dict]) -> set[tuple[str, str, str]]:
    return {(r["verb"], r["group"], r["resource"] + (f"/{r['subresource']}" if r["subresource"] else ""))
            for r in requests}


@pytest.fixture(scope="module")
def e2e_requests(tmp_path_factory, pytestconfig) -> list[dict]:
    """The operator's requests during tests/operator/test_operator_e2e.py, all of it: from this session's run of
    it where it ran before this module (tests/conftest.py orders it so), else from a pytest run of its own."""
    ran = pytestconfig.stash.get(MODULE_REQUESTS, {}).get(E2E_MODULE)
    if ran is not None:
        assert ran.failed == 0, f"the operator e2e suite failed: {ran.failed} of its tests (above)"
        requests = ran.requests
    else:
        log = tmp_path_factory.mktemp("rbac") / "requests.json"
        env = {**os.environ, "PDPOOL_K8S_REQUEST_LOG": str(log)}
        proc = subprocess.run([sys.executable, "-m", "pytest", f"tests/operator/{E2E_MODULE}.py", "-q", "-x",
                               "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, "the operator e2e suite failed:\n" + proc.stdout[-4000:]
        requests = json.loads(log.with_name(f"requests.json.{E2E_MODULE}").read_text())
    mine = [r for r in requests if r["user_agent"].startswith(OPERATOR_AGENTS)]
    assert mine, {r["user_agent"] for r in requests}
    return mine


def allows(rules: list[dict], request: dict) -> bool:
    """As the RBAC authorizer decides: a rule with resourceNames allows only requests for those names."""
    return any(request["verb"] in rule["verbs"] and request["group"] in rule["apiGroups"]
               and request["resource"] in rule["resources"]
               and (not rule.get("resourceNames") or request["name"] in rule["resourceNames"]) for rule in rules)


def test_every_call_is_allowed_and_every_rule_is_used(e2e_requests):
    docs = render(*VALUE_SETS["namespaced"])
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    pools = triples(roles[("serving", "pdpool")]["rules"])
    leader = triples(roles[(NAMESPACE, "pdpool-leader")]["rules"])
    leases = [r for r in e2e_requests if r["resource"] == "leases"]
    rest = [r for r in e2e_requests if r["resource"] != "leases"]
    # the e2e operator watches "default" and keeps its Lease there: the chart's two Roles, by what they cover
    missing = (called(rest) - pools) | (called(leases) - leader)
    assert not missing, f"calls the chart does not allow: {sorted(missing)}"
    refused = {(r["verb"], r["name"]) for r in leases if not allows(roles[(NAMESPACE, "pdpool-leader")]["rules"], r)}
    assert not refused, f"Lease calls outside the release's own Lease: {sorted(refused)}"
    unused = (pools - called(rest) - triples(DISCOVERY_RULES)) | (leader - called(leases))
    assert not unused, f"rules no call uses: {sorted(unused)}"
    assert triples(DISCOVERY_RULES) <= pools, "the operator must hold what it grants the router"


def test_a_namespaced_operator_makes_no_cluster_scoped_request(e2e_requests):
    cluster_scoped = [r for r in e2e_requests if r["namespace"] is None]
    assert cluster_scoped == [], cluster_scoped[:5]


def test_cluster_wide_rules_are_the_namespaced_ones():
    docs = render()
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    role = next(d for d in render(*VALUE_SETS["namespaced"]) if d["kind"] == "Role"
                and d["metadata"]["name"] == "pdpool")
    assert cluster_role["rules"] == role["rules"]
