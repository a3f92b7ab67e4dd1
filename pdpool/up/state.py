"""The state file of a running ``pdpool up``: how ``pdpool status`` finds the pool without flags.

``$PDPOOL_CACHE/up/<router port>.json`` (default ``~/.cache/pdpool/up/``), owner-only (it holds the local Redis
password), rewritten atomically on every change of a process's state, removed when ``up`` stops.
"""

from __future__ import annotations

import contextlib
import json
import os
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


def running() -> list[dict]:
    """States of the ``pdpool up`` processes still alive (stale files of a killed ``up`` are skipped)."""
    out = []
    for path in sorted(state_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(path.read_text())
            if _alive(int(state["pid"])):
                out.append(state)
    return out
