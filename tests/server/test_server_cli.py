"""`pdpool` dispatch and `pdpool serve` flag validation (no model is loaded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdpool import cli


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert cli.main(["bogus"]) == 2
    assert cli.main(["--help"]) == 0
    err = capsys.readouterr().err
    assert "serve" in err and "operator" in err


def test_serve_rejects_out_of_range_flags_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--max-num-seqs", "0"])
    assert info.value.code == 2
    assert "--max-num-seqs: 0 is below the minimum 1" in capsys.readouterr().err


def test_operator_is_dispatched():
    out = subprocess.run([sys.executable, "-m", "pdpool.cli", "operator", "crd"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kind: CustomResourceDefinition" in out.stdout


def test_serve_takes_the_model_as_vllm_serve_does(tmp_path, capsys):
    """`vllm serve MODEL`: the model as the first positional argument, the same as --model. It reaches the model
    check (a folder that does not exist is exit status 2, named), and --model with another value is refused."""
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["serve", missing, "--max-num-seqs", "2"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert cli.main(["serve", missing, "--model", missing]) == 2   # the same model twice: taken
    assert "no-such-model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", missing, "--model", "demo"])
    assert info.value.code == 2
    assert "the model is given twice" in capsys.readouterr().err
