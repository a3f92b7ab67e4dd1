"""``--enable-auto-tool-choice`` and ``--tool-call-parser`` (pdpool/config.py) reach both processes that validate
chat requests, the nodes and the router, from the CLI, the router's YAML and the InferencePool spec
(``model.enableAutoToolChoice``, ``model.toolCallParser``; ``pdpool up`` and the operator read the same spec)."""

from __future__ import annotations

import argparse

import pytest

from operator_examples import make_body
from pdpool import config
from pdpool.operator.builders.nodes import node_config
from pdpool.operator.builders.router import router_config
from pdpool.operator.spec import SpecError, parse_pool
from pdpool.router import settings

AUTO = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def serve_config(argv: list[str]) -> config.NodeConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(argv))


def test_serve_and_router_flags_round_trip():
    node = serve_config(AUTO)
    assert config.auto_tool_parser(node.server) == "pythonic"
    assert config.to_argv(node) == AUTO
    router, _ = settings.load(AUTO)
    assert config.auto_tool_parser(router.router) == "pythonic"
    assert config.auto_tool_parser(serve_config(["--tool-call-parser", "hermes"]).server) is None  # auto not on


@pytest.mark.parametrize("cfg_cls", [config.NodeConfig, config.RouterCommandConfig])
def test_auto_without_a_parser_is_a_startup_error(cfg_cls):
    with pytest.raises(config.ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        config.build(cfg_cls, enable_auto_tool_choice=True)
    with pytest.raises(config.ConfigError, match="--tool-call-parser: 'mistral' is not one of"):
        config.build(cfg_cls, tool_call_parser="mistral")


def test_the_router_yaml_takes_them(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("enable-auto-tool-choice: true\ntool_call_parser: llama3_json\n")
    cfg, _ = settings.load(["--config", str(path)])
    assert config.auto_tool_parser(cfg.router) == "llama3_json"


def test_the_pool_spec_sets_nodes_and_router():
    pool = parse_pool(make_body({"model": {"enableAutoToolChoice": True, "toolCallParser": "hermes"}}))
    for role in ("prefill", "decode"):
        argv = config.to_argv(node_config(pool, role))
        assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    argv = config.to_argv(router_config(pool), config.RouterCommandConfig)
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    with pytest.raises(SpecError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        parse_pool(make_body({"model": {"enableAutoToolChoice": True}}))
