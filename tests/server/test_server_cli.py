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
