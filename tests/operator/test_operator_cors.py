"""CORS (``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``; pdpool/config.py)
from the InferencePool spec's ``cors`` section to both processes that answer a browser: the router, which is what a
page calls, and the nodes (one policy for the pool, as ``model.trustRequestChatTemplate`` reaches both). ``pdpool
up`` and the operator read the same spec; the rendered args are parsed by the parsers ``pdpool router`` and ``pdpool
serve`` run."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from operator_examples import make_body
from pdpool import config
from pdpool.operator import builders, crd
from pdpool.operator.spec import SpecError, parse_pool
from pdpool.router import settings
from pdpool.server.cors import CorsPolicy

APP = "https://app.example"
CORS = {"allowedOrigins": [APP, "http://localhost:3000"], "allowCredentials": True,
        "allowedMethods": ["GET", "POST"], "allowedHeaders": ["Authorization", "X-Request-Id"]}
FLAGS = ("--allowed-origins", "--allow-credentials", "--allowed-methods", "--allowed-headers")


def containers(spec: dict) -> dict[str, dict]:
    objs = builders.render(parse_pool(make_body(spec)), token=lambda: "generated-once")
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]["containers"][0]
            for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != "p-redis"}


def parse_router(args: list[str]) -> config.RouterConfig:
    assert args[0] == "router"
    cfg, _ = settings.load(args[1:], environ={})   # what `pdpool router` runs (router/main.py)
    return cfg.router


def parse_serve(args: list[str]) -> config.ServerConfig:
    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)   # as pdpool.cli's `pdpool serve`
    return config.from_args(parser.parse_args(args[1:]), environ={}).server


def cors_of(section) -> dict:
    return {"allowedOrigins": section.allowed_origins, "allowCredentials": section.allow_credentials,
            "allowedMethods": section.allowed_methods, "allowedHeaders": section.allowed_headers}


def test_the_pool_spec_sets_router_and_nodes_through_their_command_lines():
    got = containers({"cors": CORS})
    assert set(got) == {"prefill", "decode", "router"}
    router = parse_router(got["router"]["args"])
    assert cors_of(router) == CORS
    for role in ("prefill", "decode"):
        assert cors_of(parse_serve(got[role]["args"])) == CORS, role
    policy = CorsPolicy.from_config(router)
    status, _, headers = policy.preflight(APP, "POST", "authorization")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert policy.preflight("https://evil.example", "POST", None)[0] == 400
    assert policy.preflight(APP, "DELETE", None)[0] == 400


def test_an_empty_list_allows_nothing_and_is_not_read_back_as_the_default():
    got = containers({"cors": {"allowedOrigins": [], "allowedHeaders": []}})
    args = got["router"]["args"]
    assert args[args.index("--allowed-origins") + 1] == "[]"
    router = parse_router(args)
    assert (router.allowed_origins, router.allowed_headers, router.allowed_methods) == ([], [], ["*"])
    assert parse_serve(got["decode"]["args"]).allowed_origins == []
    assert CorsPolicy.from_config(router).preflight(APP, "GET", None)[0] == 400


def test_without_a_cors_section_the_defaults_apply_and_no_flag_is_written():
    body = make_body({})
    pool = parse_pool(body)
    assert pool.spec["cors"] == {"allowedOrigins": ["*"], "allowCredentials": False, "allowedMethods": ["*"],
                                 "allowedHeaders": ["*"]}   # the CRD's defaults, as the API server writes them
    for c in containers({}).values():
        assert not set(FLAGS) & set(c["args"]), c["args"]
    assert cors_of(pool.router.router) == cors_of(config.RouterConfig())
    assert cors_of(pool.node.server) == cors_of(config.ServerConfig())


def _spec_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_declares_lists_of_strings_with_the_configs_defaults():
    cors = _spec_schema()["properties"]["cors"]["properties"]
    for name in ("allowedOrigins", "allowedMethods", "allowedHeaders"):
        assert cors[name]["type"] == "array" and cors[name]["items"] == {"type": "string", "pattern": "^[ -~]+$"}
        assert cors[name]["default"] == ["*"]
    assert cors["allowCredentials"] == {**cors["allowCredentials"], "type": "boolean", "default": False}
    errors = crd.schema_errors({"cors": {"allowedOrigins": APP, "allowedMethods": [1]}}, _spec_schema(), "spec")
    assert sorted(errors) == ["spec.cors.allowedMethods[0]: expected string, got 1",
                              f"spec.cors.allowedOrigins: expected array, got '{APP}'"]


@pytest.mark.parametrize("origins", [[""], ["https://caf\u00e9.example"], ["https://a.example\r\nX: y"]])
def test_a_value_no_header_can_carry_is_a_spec_error(origins):
    with pytest.raises(SpecError, match="--allowed-origins: .* is not a header value"):
        parse_pool(make_body({"cors": {"allowedOrigins": origins}}))


@given(st.text(max_size=12))
@hypothesis_settings(max_examples=300, deadline=None)
def test_the_crd_refuses_at_apply_time_what_the_config_check_refuses(value):
    """The CRD's item pattern and the config's check are one rule: a value the API server takes (its schema, with
    Go's anchors) is a value the operator can render, and one it refuses would have been an InvalidSpec."""
    refused_by_crd = bool(crd.schema_errors({"cors": {"allowedOrigins": [value]}}, _spec_schema(), "spec"))
    try:
        parse_pool(make_body({"cors": {"allowedOrigins": [value]}}))
        refused_by_config = False
    except SpecError:
        refused_by_config = True
    assert refused_by_crd == refused_by_config
