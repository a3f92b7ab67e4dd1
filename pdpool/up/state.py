"""The state file of a running ``pdpool up``: how ``pdpool status`` finds the pool without flags.

``$PDPOOL_CACHE/up/<router port>.json`` (default ``~/.cache/pdpool/up/``), owner-only (it holds the local Redis
password), rewritten atomically on every change of a process's state, removed when ``up`` stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

from pdpool.models.demo import cache_dir


def state_dir() -> Path:
    return cache_dir() / "up"


def state_path(port: int) -> Path:
    return state_dir() / f"{port}.json"


def write(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> bytes | None:
    """``pid``'s command line (empty once it is gone); None where the system has no /proc (macOS)."""
    if not Path("/proc/self").exists():
        return None
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ours(pid: int) -> bool:
    """``pid`` still runs a pool process (a pdpool child or a redis-server), not a process that reused the pid."""
    cmdline = _cmdline(pid) or b""
    return b"pdpool" in cmdline or b"redis-server" in cmdline


def _up_running(pid: int) -> bool:
    """The ``pdpool up`` that wrote a state file still runs: its pid is alive and, where /proc says, still a
    pdpool process (after a reboot, or a container's restart, that pid may run anything else)."""
    cmdline = _cmdline(pid)
    return _alive(pid) and (cmdline is None or b"pdpool" in cmdline)


def reap_stale() -> list[tuple[int, list[int]]]:
    """Stop what a killed ``pdpool up`` left running (its children live in their own sessions, so nothing else
    stops them); returns [(that up's pid, the pids stopped)] and removes its state files."""
    reaped = []
    for path in sorted(state_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            saved = json.loads(path.read_text())
            if _up_running(int(saved["pid"])):
                continue
            pids = [p["pid"] for p in saved["processes"] if p.get("pid")]
            pids += [saved["redis_pid"]] if saved.get("redis_pid") else []
            stopped = [pid for pid in pids if _ours(pid)]
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # each child leads its own process group
            if saved.get("run_dir"):
                shutil.rmtree(saved["run_dir"], ignore_errors=True)
            remove(path)
            reaped.append((int(saved["pid"]), stopped))
    return reaped


def running() -> list[dict]:
    """States of the ``pdpool up`` processes still alive (stale files of a killed ``up`` are skipped)."""
    out = []
    for path in sorted(state_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(path.read_text())
            if _up_running(int(state["pid"])):
                out.append(state)
    return out
