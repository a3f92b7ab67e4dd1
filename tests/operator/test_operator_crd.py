"""The CRD is generated from the config schema; the committed crd.yaml is that rendering."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

from pdpool import config
from pdpool.operator import crd, schema
from pdpool.operator.main import main


def test_committed_crd_is_the_generated_one(capsys):
    assert crd.CRD_PATH.read_text() == crd.render_crd(), "run: pdpool operator crd > operator/crd.yaml"
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd.render_crd()


def _leaves(node: dict, prefix: str = "") -> dict[str, dict]:
    out = {}
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        if path in schema.DEPLOYMENT_FIELDS or "properties" not in sub:
            out[path] = sub
        else:
            out.update(_leaves(sub, path + "."))
    return out


def _spec_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_every_spec_field_is_a_setting_or_a_declared_deployment_field():
    leaves = _leaves(_spec_schema())
    settings = crd.config_fields()
    undeclared = set(leaves) - set(settings) - set(schema.DEPLOYMENT_FIELDS)
    assert not undeclared, f"spec fields neither in pdpool.config nor in schema.DEPLOYMENT_FIELDS: {undeclared}"
    assert set(settings) | set(schema.DEPLOYMENT_FIELDS) == set(leaves)


def test_crd_defaults_and_bounds_are_the_configs():
    leaves = _leaves(_spec_schema())
    for path, users in crd.config_fields().items():
        for _, f in users:
            m, leaf = f.metadata, leaves[path]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # a list
            assert leaf.get("default") == (None if default is None else default), path
            assert leaf.get("enum") == (list(m["choices"]) if m.get("choices") else None), path
            assert leaf.get("minimum") == m.get("ge") and leaf.get("maximum") == m.get("le"), path


def _cli_flags(*argv: str) -> set[str]:
    """The flags the real command line offers (``--help`` exits before anything heavy is imported)."""
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", *argv, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {w.rstrip(",") for w in out.stdout.split() if w.startswith("--")}


def test_node_fields_map_to_real_pdpool_serve_flags():
    serve_flags = _cli_flags("serve")
    for path, users in crd.config_fields().items():
        for cfg_cls, f in users:
            if cfg_cls is config.NodeConfig:
                assert config.flag_name(f) in serve_flags, f"{path}: pdpool serve has no {config.flag_name(f)}"


def test_router_fields_map_to_router_flags():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, config.RouterCommandConfig)
    flags = {a for action in parser._actions for a in action.option_strings}
    routed = [(p, f) for p, users in crd.config_fields().items() for c, f in users if c is config.RouterCommandConfig]
    assert routed
    for path, f in routed:
        assert config.flag_name(f) in flags, path


def test_names_and_printer_columns():
    body = crd.build_crd()
    assert body["metadata"]["name"] == "inferencepools.pdpool.io"
    names = body["spec"]["names"]
    assert (names["kind"], names["shortNames"], body["spec"]["scope"]) == ("InferencePool", ["pdpool"], "Namespaced")
    version = body["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Model", "Prefill", "Decode", "Router", "Ready", "Age"]


def test_crd_validates_as_kubernetes_object():
    import kubernetes_validate

    kubernetes_validate.validate(crd.build_crd(), "1.33", strict=True)
