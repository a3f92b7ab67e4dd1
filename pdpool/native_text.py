"""The front end's native piece table and block-hash chain, and the router's approximate prefix index
(``pdpool/csrc/pieces.c``), used by the router's token cache, by ``pdpool.block_hash`` (engines and router alike)
and by ``router/prefix_index.py``: built with the C compiler and Python's headers, once per source and Python, and
loaded by path; no torch, no build tool beyond ``cc``.

    python -m pdpool.native_text        # build ahead of time (the image, CI); prints the module's path

``load()`` returns the module, building it first when it is missing, or None (with one warning) where it cannot
be built: no compiler, no ``Python.h``, no writable folder. The front end then keeps its Python path, which
gives the same ids (``tests/router/test_token_cache.py``) and index answers
(``tests/router/test_approx_index_native.py``). ``PDPOOL_ROUTER_NATIVE=0`` turns it off.

Where it goes: ``$PDPOOL_ROUTER_NATIVE_DIR``; else ``<venv>/share/pdpool/router`` inside a virtual environment;
else ``$PDPOOL_CACHE/router`` (``~/.cache/pdpool/router``); when that folder is not writable, a per-user temporary
folder. The file name carries a hash of the source, the flags and the Python ABI, so a changed source is rebuilt
and never loaded stale; the build writes a temporary file and renames it, so a half-written module is never
loaded and two builders at once are harmless.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

log = logging.getLogger("pdpool.native")

NAME = "pdpool_router_pieces"
SOURCE = Path(__file__).parent / "csrc" / "pieces.c"
CFLAGS = ["-O2", "-shared", "-fPIC", "-std=c11", "-Wall"]
_loaded: list = []   # [module or None] once tried


def _folders() -> list[Path]:
    if os.environ.get("PDPOOL_ROUTER_NATIVE_DIR"):
        return [Path(os.environ["PDPOOL_ROUTER_NATIVE_DIR"])]
    if sys.prefix != sys.base_prefix:
        first = Path(sys.prefix) / "share" / "pdpool" / "router"
    else:
        first = Path(os.environ.get("PDPOOL_CACHE") or Path.home() / ".cache" / "pdpool") / "router"
    return [first, Path(tempfile.gettempdir()) / f"pdpool-router-{os.getuid()}"]


def _file_name() -> str:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + sys.version.encode()
                         + (sysconfig.get_config_var("SOABI") or "").encode()).hexdigest()[:16]
    return f"{NAME}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def build(folder: Path) -> Path:
    """Compile into ``folder`` (unless there already); returns the module's path. Raises ``OSError`` or
    ``subprocess.CalledProcessError``."""
    target = folder / _file_name()
    if target.is_file():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise OSError(f"no Python.h in {include} (install Python's development headers, e.g. python3-dev)")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, f"-I{include}", str(SOURCE), "-o", tmp], check=True, capture_output=True,
                       timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The built module, or None where it cannot be had (logged once)."""
    if _loaded:
        return _loaded[0]
    module, errors = None, []
    if os.environ.get("PDPOOL_ROUTER_NATIVE", "1") != "0":
        for folder in _folders():
            try:
                module = _import(build(folder))
                break
            except subprocess.CalledProcessError as exc:
                errors.append(f"{folder}: {exc.stderr.decode(errors='replace').strip()[-500:]}")
                break   # the compiler refused the source: another folder will not help
            except (OSError, ImportError, subprocess.SubprocessError) as exc:
                errors.append(f"{folder}: {exc}")
        if module is None:
            log.warning("pdpool's native text module (pdpool/csrc/pieces.c) is unavailable, so fresh text is "
                        "tokenized, block hashes computed and the approximate index kept in Python (same results, "
                        "more CPU): %s",
                        "; ".join(errors))
    _loaded.append(module)
    return module


def main() -> None:
    module = load()
    if module is None:
        sys.exit("the router's native piece table did not build (see above)")
    print(module.__file__)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
