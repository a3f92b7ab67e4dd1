"""CORS on a node, as vLLM serves it (``pdpool.server.cors``; the checks are tests/cors_checks.py, which the router
passes too): the package's node (defaults, with an API key), and nodes with listed origins, methods and headers and
with ``--allow-credentials``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cors_checks  # noqa: E402


def _node(launch_server, *flags: str):
    return launch_server("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "32", "--block-size",
                         "16", "--max-num-seqs", "4", *flags, api_key="cors-key")


@pytest.fixture(scope="module")
def listed_node(launch_server):
    srv = _node(launch_server, "--allowed-origins", f'["{cors_checks.ORIGIN}"]', "--allowed-methods", "POST",
                "--allowed-methods", "GET", "--allowed-headers", '["Authorization", "X-Custom"]')
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def credentials_node(launch_server):
    srv = _node(launch_server, "--allow-credentials")
    yield srv
    srv.stop()


def test_a_preflight_needs_no_key_and_any_origin_is_allowed_by_default(server):
    cors_checks.check_default_preflight_needs_no_key(server.url)


def test_answers_errors_and_streams_carry_allow_origin(server):
    cors_checks.check_default_answers_carry_allow_origin(server.url, server.api_key)


def test_an_options_request_that_is_no_preflight_needs_the_key(server):
    cors_checks.check_options_that_is_no_preflight_needs_the_key(server.url, server.api_key)


def test_listed_origins_methods_and_headers(listed_node):
    cors_checks.check_listed_origins_methods_and_headers(listed_node.url)


def test_credentials_with_any_origin(credentials_node):
    cors_checks.check_credentials_with_any_origin(credentials_node.url)


@pytest.mark.parametrize("which", ["server", "listed_node"])
def test_no_cors_request_is_a_5xx(which, request):
    cors_checks.check_no_cors_request_is_a_5xx(request.getfixturevalue(which).url)
