"""Build the native CPU decode kernel ahead of serving (``pdpool build-kernels``), and load it without waiting forever.

torch.utils.cpp_extension guards a build folder with a baton: a ``lock`` file created with O_EXCL and removed when
the build ends. A process killed mid-build leaves it behind, and every later ``load`` polls for it forever, silently.
The file holds no pid, so nothing in it tells a live build from a dead one. Here every process that touches the
folder first takes an flock on a sidecar file, exclusive to build, shared to load. The kernel drops an flock when its
holder dies, so a baton seen while holding the sidecar flock belongs to nobody alive: it is removed, with a warning.
Two builders starting at once take turns; the second finds the kernel built and only loads it::

    <build dir>/                  (one per machine: -march=native code must not run on another CPU)
      pdpool.flock                LOCK_EX while building (holds the builder's pid), LOCK_SH while loading
      lock                        torch's baton: present during a build, otherwise stale
      pdpool_paged_decode_cpu.so  the module (decode attention, KV store, fused elementwise ops, small-row linear;
                                  csrc/); loaded by path, without torch's baton or ninja
      pdpool-build.json           written after a build succeeded (its key: source, flags, torch, Python); removed
                                  before a build starts, so a half-built module is never loaded

Every wait is bounded (``--timeout``; ``PDPOOL_KERNEL_BUILD_TIMEOUT``, default 600 s) and says what it waits for.
A node that finds the kernel unbuilt runs this command as a child under that bound (same progress output); where
that fails the attention backend falls back to torch, with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("pdpool.kernels.build")  # also when run as __main__

NAME = "pdpool_paged_decode_cpu"
CSRC = Path(__file__).parent / "csrc"
# One module: the bindings, paged decode attention (and the KV store), the decoder layer's fused elementwise ops,
# the small-row linear layer, the sampler's one pass.
SOURCES = [CSRC / "module_cpu.cpp", CSRC / "paged_decode_cpu.cpp", CSRC / "fused_ops_cpu.cpp", CSRC / "linear_cpu.cpp",
           CSRC / "sample_cpu.cpp"]
HEADERS = [CSRC / "cpu_vec.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
FLOCK, BATON, STAMP = "pdpool.flock", "lock", "pdpool-build.json"
DEFAULT_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 10.0


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded (compile error, no compiler, a wait past its bound)."""


def build_dir() -> Path:
    """``$PDPOOL_KERNEL_DIR`` as given; else a per-machine folder inside the virtual environment (the module is tied
    to that environment's torch, and ``make clean`` removes it with the venv); else in the user cache."""
    if os.environ.get("PDPOOL_KERNEL_DIR"):
        return Path(os.environ["PDPOOL_KERNEL_DIR"])
    if sys.prefix != sys.base_prefix:
        base = Path(sys.prefix) / "share" / "pdpool" / "kernels"
    else:
        base = Path(os.environ.get("PDPOOL_CACHE") or Path.home() / ".cache" / "pdpool") / "kernels"
    return base / f"{platform.machine()}-{platform.node() or 'host'}"


def default_timeout() -> float:
    return float(os.environ.get("PDPOOL_KERNEL_BUILD_TIMEOUT") or DEFAULT_TIMEOUT_S)


def library_path(where: Path) -> Path:
    return where / f"{NAME}.so"


def build_key() -> str:
    import torch

    parts = [NAME, *CFLAGS, *LDFLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine()]
    code = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    return hashlib.sha256(code + "\0".join(parts).encode()).hexdigest()


def is_built(where: Path, key: str | None = None) -> bool:
    try:
        stamp = json.loads((where / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("key") == (key or build_key()) and library_path(where).is_file()


def build(where: Path | None = None, *, timeout: float | None = None, force: bool = False,
          verbose: bool = True) -> Path:
    """Compile the kernel into ``where`` (default ``build_dir()``) unless it is built already; returns the module's
    path. Waits at most ``timeout`` seconds for another builder; the compile itself is not bounded here (a node
    bounds it by running this in a child)."""
    where = where or build_dir()
    where.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (default_timeout() if timeout is None else timeout)
    key = build_key()  # imports torch: before the lock, which others may be waiting for
    import torch.utils.cpp_extension  # noqa: F401
    with _dir_lock(where, exclusive=True, deadline=deadline):
        _remove_stale_baton(where)
        if not force and is_built(where, key):
            log.info("the CPU decode kernel is already built: %s", library_path(where))
            return library_path(where)
        (where / STAMP).unlink(missing_ok=True)
        log.info("building the CPU kernels (%s, %s; a few minutes) in %s", ", ".join(p.name for p in SOURCES),
                 " ".join(CFLAGS), where)
        start = time.monotonic()
        with _progress(start, "compiling the CPU decode kernel"):
            _compile(where, verbose)
        (where / STAMP).write_text(json.dumps({"key": key, "sources": [str(p) for p in SOURCES], "cflags": CFLAGS}))
        log.info("built the CPU decode kernel in %.0f s: %s", time.monotonic() - start, library_path(where))
    return library_path(where)


def load(timeout: float | None = None):
    """The compiled module. Where it is not built yet, builds it first in a child process (``python -m
    pdpool.kernels.build``, so the compile is bounded too); then imports it by path under a shared lock."""
    where, key = build_dir(), build_key()
    timeout = default_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    if not is_built(where, key):
        _build_in_child(where, deadline, timeout)
    with _dir_lock(where, exclusive=False, deadline=deadline):
        _remove_stale_baton(where)  # no builder holds the exclusive lock, so a baton here is stale
        if not is_built(where, key):
            raise KernelBuildError(f"the CPU decode kernel is not built in {where} (run `pdpool build-kernels`)")
        spec = importlib.util.spec_from_file_location(NAME, library_path(where))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _build_in_child(where: Path, deadline: float, timeout: float) -> None:
    log.info("the CPU decode kernel is not built yet; building it now (`pdpool build-kernels` does this ahead)")
    remaining = max(1.0, deadline - time.monotonic())
    env = dict(os.environ, PDPOOL_KERNEL_DIR=str(where))
    cmd = [sys.executable, "-m", "pdpool.kernels.build", "--timeout", f"{remaining:.0f}"]
    # Its own session, so that a timeout kills the compiler under it too (the compiler's group).
    child = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = child.wait(timeout=remaining)
    except BaseException as e:  # the bound, or Ctrl-C / a signal handler raising in this process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise KernelBuildError(f"the CPU decode kernel did not build within {timeout:.0f} s "
                                   f"(PDPOOL_KERNEL_BUILD_TIMEOUT); stopped the build in {where}") from None
        raise
    if code != 0:
        raise KernelBuildError(f"`pdpool build-kernels` failed (exit {code}); its output is above")


@contextlib.contextmanager
def _dir_lock(where: Path, exclusive: bool, deadline: float) -> Iterator[None]:
    """An flock on the sidecar file, polled (never a blocking wait) until ``deadline``."""
    fd = os.open(where / FLOCK, (os.O_RDWR if exclusive else os.O_RDONLY) | os.O_CREAT, 0o644)
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        start = next_note = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    raise KernelBuildError(f"gave up after {now - start:.0f} s waiting for {_holder(where)} to "
                                           f"release {where / FLOCK} (PDPOOL_KERNEL_BUILD_TIMEOUT)") from None
                if now >= next_note:
                    log.info("waiting for %s to finish with the CPU decode kernel in %s (%.0f s)", _holder(where),
                             where, now - start)
                    next_note = now + PROGRESS_EVERY_S
                time.sleep(0.2)
        if exclusive:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            if exclusive:
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # drops the flock


def _holder(where: Path) -> str:
    try:
        pid = (where / FLOCK).read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid} (building)" if pid else "another process"


def _remove_stale_baton(where: Path) -> None:
    """Called with the sidecar lock held: every live builder holds it exclusively, so a baton now is a dead one's."""
    baton = where / BATON
    if baton.exists():
        log.warning("removing a stale build lock %s, left by a kernel build that was killed", baton)
        baton.unlink(missing_ok=True)


@contextlib.contextmanager
def _progress(start: float, what: str) -> Iterator[None]:
    """An elapsed-time line every PROGRESS_EVERY_S, so that a long compile never looks like a hang."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            log.info("%s ... %.0f s", what, time.monotonic() - start)

    ticker = threading.Thread(target=tick, name="kernel-build-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def _compile(where: Path, verbose: bool) -> None:
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    try:
        load_extension(name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(where),
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),  # copies: torch appends to them
                       verbose=verbose)
    except Exception as e:  # no compiler, no ninja, a compile error (torch's message carries the compiler's output)
        raise KernelBuildError(f"{type(e).__name__}: {str(e).strip()}") from e


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` dependency installs it beside this interpreter, whose folder is
    not on PATH when the venv is not activated (``.venv/bin/python -m ...``)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdpool build-kernels", description="Build the native CPU decode kernel "
                                     "ahead of serving (otherwise a node builds it at its first start).")
    parser.add_argument("--force", action="store_true", help="rebuild even if it is built")
    parser.add_argument("--quiet", action="store_true", help="progress lines only, not the compiler's commands")
    parser.add_argument("--timeout", type=float, default=default_timeout(), metavar="S",
                        help="seconds to wait for another build of the same folder (default %(default)s)")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build(timeout=args.timeout, force=args.force, verbose=not args.quiet)
    except KernelBuildError as e:
        log.error("error: the CPU decode kernel did not build: %s\n(it needs a C++ compiler with OpenMP and ninja; "
                  "without it nodes use the torch attention backend)", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
