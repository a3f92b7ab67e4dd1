"""CORS on the router, as vLLM serves it (``pdpool.server.cors``; the checks are tests/cors_checks.py, which a node
passes too): routers over one colocated node, with the defaults and an API key, with listed origins, methods and
headers from the YAML ``--config``, and with ``--allow-credentials``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cors_checks  # noqa: E402

KEY = "cors-key"


@pytest.fixture(scope="module")
def node(colocated_node):
    return colocated_node


@pytest.fixture(scope="module")
def router(node, start_router):
    return start_router(["--both", node.url], name="router-cors", api_key=KEY)


@pytest.fixture(scope="module")
def listed_router(node, start_router, tmp_path_factory):
    path = tmp_path_factory.mktemp("cors") / "router.yaml"
    path.write_text(f"both: {node.url}\nallowed-origins: ['{cors_checks.ORIGIN}']\nallowed_methods: [POST, GET]\n")
    return start_router(["--config", str(path), "--allowed-headers", "Authorization", "--allowed-headers",
                         "X-Custom"], name="router-cors-listed", api_key=KEY)


@pytest.fixture(scope="module")
def credentials_router(node, start_router):
    return start_router(["--both", node.url, "--allow-credentials"], name="router-cors-credentials")


def test_a_preflight_needs_no_key_and_any_origin_is_allowed_by_default(router):
    cors_checks.check_default_preflight_needs_no_key(router.url)


def test_answers_errors_and_streams_carry_allow_origin(router):
    cors_checks.check_default_answers_carry_allow_origin(router.url, KEY)


def test_an_options_request_that_is_no_preflight_needs_the_key(router):
    cors_checks.check_options_that_is_no_preflight_needs_the_key(router.url, KEY)


def test_listed_origins_methods_and_headers(listed_router):
    cors_checks.check_listed_origins_methods_and_headers(listed_router.url)


def test_credentials_with_any_origin(credentials_router):
    cors_checks.check_credentials_with_any_origin(credentials_router.url)


@pytest.mark.parametrize("which", ["router", "listed_router"])
def test_no_cors_request_is_a_5xx(which, request):
    cors_checks.check_no_cors_request_is_a_5xx(request.getfixturevalue(which).url)
