"""``pdpool router --config FILE.yaml`` reads its file with ``pdpool serve``'s loader (``pdpool.config``): any file
is a working config or a clear error naming the file (a ``SettingsError``, exit status 2), never a traceback."""

from __future__ import annotations

import os
import string
import tempfile

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpool import config
from pdpool.router import settings as router_settings


def load(text: str | bytes) -> tuple[config.RouterCommandConfig | None, str]:
    """(the config, "") or (None, the error) of ``pdpool router --config FILE --both http://n0:8000``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "router.yaml")
        with open(path, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        try:
            cfg, scheduler = router_settings.load(["--config", path, "--both", "http://n0:8000"], environ={})
            router_settings.profile(cfg, scheduler)
        except router_settings.SettingsError as exc:
            message = str(exc)
            assert path in message or message.startswith("scheduler:") or "needs --tool-call-parser" in message
            return None, message
        return cfg, ""


@pytest.mark.parametrize("text, key", [
    (b"port: \xff\xfe\n", "utf-8"),          # not UTF-8: was a UnicodeDecodeError's traceback
    ("port:\n", "port"),                     # null: was taken, a port of None
    ("max-inflight: true\n", "max-inflight"),   # YAML's true: was taken as a limit of 1
    ("prefix-weight: .nan\n", "prefix-weight"),   # was taken: NaN passes every bound
])
def test_a_bad_file_is_a_clear_error(text, key):
    cfg, error = load(text)
    assert cfg is None and key in error, error


_FLAGS = [f.name for _, f in config.all_options(config.RouterCommandConfig)]
_KEYS = st.sampled_from(_FLAGS).flatmap(lambda n: st.sampled_from([n, n.replace("_", "-")])) | st.text(
    string.ascii_letters + "-_", min_size=1, max_size=12)
_VALUES = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12) | st.lists(
    st.text(max_size=8) | st.integers(), max_size=3)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=4) | st.binary(max_size=40))
def test_any_file_is_a_config_or_a_clear_error(data):
    cfg, error = load(data if isinstance(data, bytes) else yaml.safe_dump(data))
    if cfg is not None:
        config.validate(cfg)
        assert cfg.router.port is not None and not isinstance(cfg.router.max_inflight, bool)
