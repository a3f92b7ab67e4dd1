"""schemathesis against the router's /openapi.json (``tests/schemathesis_run.py``): a router with an API key in
front of a real node (static discovery), the package's colocated node (a 512-token context; no key: the router's
legs present none)."""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis")

import schemathesis_run  # noqa: E402  (tests/ is on sys.path)

API_KEY = "st-key-42"


@pytest.fixture(scope="module")
def router(colocated_node, start_router):
    return start_router(["--both", colocated_node.url], name="router-schemathesis", api_key=API_KEY)


@pytest.mark.timeout(600)
def test_router_openapi_holds_under_schemathesis(router):
    cases, problems = schemathesis_run.run(schemathesis_run.load(router.url, API_KEY))
    assert not problems, "\n\n".join(problems)
    assert cases > 100
