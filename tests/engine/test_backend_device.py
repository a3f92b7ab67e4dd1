"""An attention backend that cannot run on the node's device is refused when the node loads, with a message that
names the flags, not served as a 500 on every request.

``pdpool serve --attention-backend triton`` on a machine without CUDA (and without Triton's interpreter) used to
report ready and then fail each request's first step inside Triton ("0 active drivers"), answering 500.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdpool.attention import pick_backend
from pdpool.node_process import NodeProcess, ProcessExited


def test_triton_on_the_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"--attention-backend triton.*--device cuda"):
        pick_backend("triton", torch.device("cpu"))


def test_the_native_cpu_backend_on_cuda_is_refused():
    with pytest.raises(ValueError, match=r"--attention-backend cpu.*--device cpu"):
        pick_backend("cpu", torch.device("cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the point is a machine without CUDA")
def test_a_node_started_with_triton_on_the_cpu_exits_with_the_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    node = NodeProcess("triton-on-cpu")
    node.launch(node.serve_argv(["--attention-backend", "triton", "--num-kv-blocks", "32"]), env,
                tmp_path / "node.log")
    try:
        with pytest.raises((ProcessExited, RuntimeError)):  # exited, or caught reporting 'failed'
            node.wait_ready(180)
        assert node.proc.wait(30) == 1
        assert "--attention-backend triton" in node.log_tail()
    finally:
        node.stop()
