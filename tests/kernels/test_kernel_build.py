"""Building the CPU decode kernel ahead of serving (kernels/build.py), in real processes with the real compiler.

A build killed mid-compile leaves torch's baton (``<build dir>/lock``) behind; before this, every later load polled
for it forever. Here: a stale baton is removed and reported by a build and by a load; a live build is waited for, and
the wait is bounded (then the attention backend falls back to torch); two builders and a node's first use starting
at once all succeed, one building while the others wait. No test compiles cold: they copy the installed build
(``make install`` runs ``pdpool build-kernels``; if it did not, the first test builds it there), and the concurrent
one starts from a copy whose link step never ran, so that ninja, torch's baton and the linker do real work (a few
seconds) while the others wait. (A cold compile takes one to six minutes on the shared test machine.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdpool.kernels import build

LOAD_CPU_KERNEL = ("import logging, torch; from pdpool.attention import pick_backend; "  # a node start logs at INFO
                   "logging.basicConfig(level=logging.INFO); "
                   "print('backend', pick_backend('auto', torch.device('cpu')).name)")
KILLED_BUILD = ("import os, signal, sys; from torch.utils.file_baton import FileBaton; "
                "assert FileBaton(sys.argv[1]).try_acquire(); os.kill(os.getpid(), signal.SIGKILL)")


def run(argv: list[str], kernel_dir: Path | None = None, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ, **env)
    if kernel_dir is not None:
        environ["PDPOOL_KERNEL_DIR"] = str(kernel_dir)
    return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=timeout)


def python(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code, *args], **kw)


def spawn(argv: list[str], kernel_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(argv, env=dict(os.environ, PDPOOL_KERNEL_DIR=str(kernel_dir)), stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def leave_a_killed_build(kernel_dir: Path) -> Path:
    """torch's baton exactly as a build killed mid-compile leaves it: created by FileBaton, its process SIGKILLed."""
    baton = kernel_dir / build.BATON
    done = python(KILLED_BUILD, str(baton))
    assert done.returncode == -signal.SIGKILL and baton.exists()
    return baton


def test_build_kernels_command_exits_0():
    done = run([sys.executable, "-m", "pdpool.cli", "build-kernels", "--quiet"], timeout=600)
    assert done.returncode == 0, done.stderr
    assert str(build.library_path(build.build_dir())) in done.stderr  # the line after says where it went
    assert build.is_built(build.build_dir())


@pytest.fixture
def built_copy(tmp_path) -> Path:
    """A private copy of the installed build, so that a planted lock never touches a folder others use."""
    build.build(verbose=False)
    copy = tmp_path / "kernels"
    shutil.copytree(build.build_dir(), copy)
    return copy


def test_a_stale_lock_does_not_hang_a_load_and_is_reported(built_copy):
    baton = leave_a_killed_build(built_copy)
    start = time.monotonic()
    done = python(LOAD_CPU_KERNEL, kernel_dir=built_copy, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "backend cpu" in done.stdout
    assert f"removing a stale build lock {baton}" in done.stderr
    assert not baton.exists()
    assert time.monotonic() - start < 60


def test_a_stale_lock_does_not_hang_a_build_and_is_reported(built_copy):
    baton = leave_a_killed_build(built_copy)
    done = run([sys.executable, "-m", "pdpool.kernels.build", "--quiet"], kernel_dir=built_copy, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"removing a stale build lock {baton}" in done.stderr
    assert "is already built" in done.stderr
    assert not baton.exists()


def test_a_live_build_is_waited_for_within_a_bound_then_torch_serves(built_copy):
    baton = built_copy / build.BATON
    with build._dir_lock(built_copy, exclusive=True, deadline=time.monotonic() + 5):  # a build in progress
        baton.touch()
        start = time.monotonic()
        done = python(LOAD_CPU_KERNEL, kernel_dir=built_copy, timeout=60, PDPOOL_KERNEL_BUILD_TIMEOUT="3")
        waited = time.monotonic() - start
        assert baton.exists(), "a live build's lock was removed"
    assert done.returncode == 0, done.stderr
    assert "backend torch" in done.stdout
    assert f"waiting for pid {os.getpid()} (building)" in done.stderr
    assert "gave up after 3 s" in done.stderr and "using the torch attention backend" in done.stderr
    assert waited < 30


def test_a_failed_build_exits_non_zero_with_a_clear_message(tmp_path):
    done = run([sys.executable, "-m", "pdpool.kernels.build", "--quiet"], kernel_dir=tmp_path, timeout=60,
               PATH="/nonexistent", CXX="/nonexistent/c++")
    assert done.returncode == 1
    assert "error: the CPU decode kernel did not build" in done.stderr
    assert not build.is_built(tmp_path)


def test_two_builders_at_once_both_succeed_one_builds(built_copy, tmp_path):
    """Two `pdpool build-kernels` and a node's first use, held at the lock until all three wait, then let go at once."""
    kernel_dir = built_copy
    for name in (build.library_path(kernel_dir).name, build.STAMP):  # as if killed before the link step
        (kernel_dir / name).unlink()
    logs = [tmp_path / f"builder{i}.log" for i in range(3)]
    with build._dir_lock(kernel_dir, exclusive=True, deadline=time.monotonic() + 5):
        builders = [spawn([sys.executable, "-m", "pdpool.kernels.build", "--quiet"], kernel_dir, logs[0]),
                    spawn([sys.executable, "-m", "pdpool.kernels.build", "--quiet"], kernel_dir, logs[1]),
                    spawn([sys.executable, "-c", LOAD_CPU_KERNEL], kernel_dir, logs[2])]
        deadline = time.monotonic() + 240
        while not all(f"waiting for pid {os.getpid()}" in log.read_text() for log in logs):
            assert all(p.poll() is None for p in builders), [log.read_text() for log in logs]
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.2)
    codes = [p.wait(timeout=300) for p in builders]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], outputs
    assert sum("built the CPU decode kernel in" in out for out in outputs) == 1, outputs
    assert sum("is already built" in out for out in outputs) == 2, outputs
    assert not any("stale" in out for out in outputs), outputs
    assert "backend cpu" in outputs[2]
    assert build.is_built(kernel_dir) and not (kernel_dir / build.BATON).exists()
