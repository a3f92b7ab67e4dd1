"""The CUTLASS decode-GEMM candidate's Python side (issue 13, eleventh pass), on the CPU: its kernel list is the
source's, its configs parse, and bad configs, a missing library and bad tensors get clear errors. The kernels
themselves were checked on the GPU by ``benchmarks/bench_decode_gemm.py --methods cutlass:all`` (docs/performance.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdpool.kernels import cutlass_gemm as cg

SOURCE = Path(cg.__file__).parent / "csrc" / "cutlass_decode_gemm.cu"


def test_the_kernel_list_is_the_sources():
    lines = re.findall(r"^CONFIG\(\d+, (\w+), (\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (true|false)\)",
                       SOURCE.read_text(), re.M)
    assert tuple(name for name, *_ in lines) == cg.KERNELS
    for name, tm, tn, tk, cm, cn, swap, pingpong in lines:
        k = cg.Kernel.parse(name)
        assert k.tile == (int(tm), int(tn), int(tk)) and k.cluster == (int(cm), int(cn))
        assert k.swap_ab == (swap == "true") and k.stream_k == (pingpong == "false")


@pytest.mark.parametrize("config, expected", [
    ("sw_sk_128x64x64_1x1", (0, 1)), ("sw_sk_128x64x64_1x1:dp", (1, 1)), ("sw_sk_128x64x64_1x1:sk", (3, 1)),
    ("sw_sk_128x256x64_2x1:s4", (2, 4)), ("sw_pp_64x64x128_1x1", (0, 1)), ("sw_pp_64x64x128_1x1:persistent", (0, 1)),
])
def test_configs_parse(config, expected):
    kernel, mode, splits = cg.parse_config(config)
    assert (mode, splits) == expected and kernel.name == config.partition(":")[0]
    assert kernel.row_tile() == (kernel.tile[1] if kernel.swap_ab else kernel.tile[0])


@pytest.mark.parametrize("config", ["nope", "sw_sk_128x64x64_1x1:s1", "sw_sk_128x64x64_1x1:sx",
                                    "sw_sk_128x64x64_1x1:fast", "sw_pp_64x64x128_1x1:dp"])
def test_bad_configs_are_refused(config):
    with pytest.raises(ValueError):
        cg.parse_config(config)


def test_a_missing_library_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cg, "_LIB", None)
    with pytest.raises(FileNotFoundError, match="build_cutlass_gemm.sh"):
        cg.load(tmp_path / "absent.so")


def test_cpu_tensors_are_refused_before_the_library_is_needed():
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        cg.linear(x, torch.zeros(8, 16, dtype=torch.bfloat16), "sw_pp_64x64x128_1x1")
