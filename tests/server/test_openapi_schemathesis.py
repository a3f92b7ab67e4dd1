"""A node's /openapi.json: it lists exactly the node's routes, and it holds under schemathesis
(``tests/schemathesis_run.py``) against the package's node (with its API key)."""

from __future__ import annotations

import httpx
import pytest

def documented(spec: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}


def test_openapi_lists_exactly_the_nodes_routes(server):
    """What a node serves is what its document lists: the app's route table (less /health, the alias of
    /health/ready, and the node-to-node /internal/ routes), read from a node's app, equals the live node's list."""
    from pdpool.config import NodeConfig
    from pdpool.server.app import create_app, served_routes

    spec = httpx.get(server.url + "/openapi.json").json()   # public, as /health and /metrics are
    table = set(served_routes(create_app(NodeConfig(), node=None))) - {("GET", "/health")}
    assert documented(spec) == table
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
            ("POST", "/detokenize"), ("GET", "/v1/models/{model}"), ("GET", "/openapi.json")} <= table
    assert spec["info"]["title"] == "pdpool node"
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]   # the package's node has a key
    model = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # "": the served model, as vLLM takes it
    assert model["properties"]["model"] == {"type": ["string", "null"], "enum": ["demo", "", None]}
    assert model["properties"]["max_tokens"]["type"] == ["integer", "null"]   # absent: 16; null: as vLLM says
    for path in ("/health/live", "/metrics", "/openapi.json"):
        assert "security" not in spec["paths"][path]["get"]


@pytest.mark.timeout(600)
def test_node_openapi_holds_under_schemathesis(server):
    pytest.importorskip("schemathesis")
    import schemathesis_run

    cases, problems = schemathesis_run.run(schemathesis_run.load(server.url, server.api_key))
    assert not problems, "\n\n".join(problems)
    assert cases > 100
