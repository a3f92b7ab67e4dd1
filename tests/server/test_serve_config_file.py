"""``pdpool serve --config FILE.yaml``, as ``vllm serve --config``: the YAML's keys are the long flag names (dashes
or underscores), a flag on the command line wins, and a file that cannot be used is a clear error naming the file
and the key (exit status 2), never a traceback. These run ``pdpool serve`` in process on a model folder that does
not exist: a config that is taken reaches the model check, which refuses the folder before anything loads."""

from __future__ import annotations

import contextlib
import io
import os
import string
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpool import cli, config

MISSING_MODEL = os.path.join(tempfile.gettempdir(), "pdpool-no-such-model-for-config-tests")


def serve(argv: list[str], text: str | bytes | None = None) -> tuple[int, str, str]:
    """(exit status, stderr, the file's path) of ``pdpool serve --config FILE --model MISSING_MODEL argv``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "serve.yaml")
        if text is not None:
            with open(path, "wb") as f:
                f.write(text.encode() if isinstance(text, str) else text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main(["serve", "--config", path, "--model", MISSING_MODEL, *argv])
            except SystemExit as exc:
                code = exc.code
        return code, err.getvalue(), path


def taken(stderr: str) -> bool:
    """The config was taken: serve went on to the model check."""
    return "pdpool-no-such-model-for-config-tests" in stderr and "--config" not in stderr


def test_file_settings_in_either_spelling_under_the_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: from-the-file\nmax-model-len: 256\nmax_num_seqs: 9\nenable_prefix_caching: false\n"
                    "served-model-name: [alpha, beta]\nallowed-origins: https://a.example\n")
    cfg = cli.serve_config(["--config", str(path), "--max-num-seqs", "3"])
    assert cfg.scheduler.max_model_len == 256 and cfg.cache.enable_prefix_caching is False
    assert cfg.scheduler.max_num_seqs == 3                       # the flag wins over the file
    assert cfg.served_model_names == ["alpha", "beta"] and cfg.served_model_name == "alpha"
    assert cfg.server.allowed_origins == ["https://a.example"]   # one value for a list setting: one item
    assert cfg.model.model == "from-the-file"
    assert cli.serve_config(["demo", "--config", str(path)]).model.model == "demo"   # the positional model wins


@pytest.mark.parametrize("text, names", [
    ("max-num-seqs: many\n", ["max-num-seqs", "expected int"]),
    ("max_num_seqs: 0\n", ["max_num_seqs", "below the minimum 1"]),
    ("max-num-seqs: true\n", ["max-num-seqs", "expected int"]),      # YAML's true is not a number
    ("port:\n", ["port", "expected int"]),                           # null where a value is needed
    ("kv-lease-seconds: .nan\n", ["kv-lease-seconds", "nan"]),
    ("role: router\n", ["role", "not one of"]),
    ("no-such-flag: 1\n", ["no-such-flag", "unknown setting"]),
    ("served-model-name: [a, 1]\n", ["served-model-name"]),
    ("- max-num-seqs\n", ["a mapping"]),
    ("max-num-seqs: [1\n", ["while parsing"]),
    (b"port: \xff\xfe\n", ["utf-8"]),
])
def test_a_file_that_cannot_be_used_is_a_clear_error_naming_it_and_the_key(text, names):
    code, err, path = serve([], text)
    assert code == 2 and "Traceback" not in err
    assert path in err, err
    for name in names:
        assert name in err, err


def test_a_missing_file_is_a_clear_error():
    code, err, path = serve([])
    assert code == 2 and path in err and "No such file" in err, err


_FLAGS = [f.name for _, f in config.all_options()]
_KEYS = st.sampled_from(_FLAGS).flatmap(lambda n: st.sampled_from([n, n.replace("_", "-")])) | st.text(
    string.ascii_letters + "-_", min_size=1, max_size=12)
_SCALARS = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                                              inner, max_size=2),
                       max_leaves=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUES, max_size=4))
def test_any_mapping_is_a_config_or_a_clear_error(data):
    code, err, path = serve([], yaml.safe_dump(data))
    assert code == 2 and "Traceback" not in err, err
    whole_config = ("--enable-auto-tool-choice needs --tool-call-parser", "--override-generation-config must be")
    assert taken(err) or path in err or any(message in err for message in whole_config), err


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=40) | st.text(max_size=40))
def test_any_bytes_are_a_config_or_a_clear_error(text):
    code, err, path = serve([], text)
    assert code == 2 and "Traceback" not in err, err
    assert taken(err) or path in err, err


def test_a_model_swallowed_by_served_model_name_is_refused():
    """--served-model-name takes every value after it (vLLM's nargs +), so a model written after the names would
    become a name and the node would serve the default model (demo) under it; vLLM refuses that order, and so does
    pdpool where two names or more come with no model otherwise given."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        cli.serve_config(["--served-model-name", "llama", "/models/llama"])
    assert "first argument" in err.getvalue(), err.getvalue()
    assert cli.serve_config(["/models/llama", "--served-model-name", "a", "b"]).served_model_names == ["a", "b"]
    assert cli.serve_config(["--served-model-name", "a", "--model", "m"]).model.model == "m"
    assert cli.serve_config(["--served-model-name", "a"]).served_model_names == ["a"]   # the operator's argv, with
    # the default model (to_argv leaves it out): one value cannot be a name and a model
    path = os.path.join(tempfile.mkdtemp(), "serve.yaml")
    with open(path, "w") as f:
        f.write("served-model-name: [a, b]\n")   # no swallowing in a file: the default model under its names
    assert cli.serve_config(["--config", path]).served_model_names == ["a", "b"]


def test_flags_take_underscores_as_vllm_serve_does():
    """``vllm serve`` reads ``--max_model_len`` as ``--max-model-len`` (the name only, never a value); so does a
    --config key, and so does ``pdpool serve``'s command line."""
    cfg = cli.serve_config(["demo", "--max_model_len=300", "--no_enable_prefix_caching", "--served_model_name",
                            "a_b", "--chat_template=--not_a_flag_here"])
    assert (cfg.scheduler.max_model_len, cfg.cache.enable_prefix_caching) == (300, False)
    assert cfg.served_model_names == ["a_b"] and cfg.model.chat_template == "--not_a_flag_here"
