"""Disaggregation fixtures (see ``cluster.py``): one redis-server and the nodes of each test module."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import running_nodes  # noqa: E402  (puts tests/ on sys.path)


@pytest.fixture(scope="module")
def start_nodes(demo_model_dir, tmp_path_factory, redis_module):
    """``start_nodes({"name": (role, [flags])})`` starts them in parallel, waits, and stops them after the module."""
    with contextlib.ExitStack() as started:
        yield lambda spec: started.enter_context(running_nodes(spec, tmp_path_factory.mktemp("nodes"),
                                                               redis_module.url))


