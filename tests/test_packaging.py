"""Every code folder is a subpackage of the one import package `pdpool`."""

import importlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder_of(package: str, package_dir: dict) -> pathlib.Path:
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / pathlib.Path(*parts[n:])
    raise AssertionError(f"{package} has no package-dir mapping")


def test_every_package_folder_is_listed():
    st = _pyproject()
    listed = set(st["packages"])
    found = set()
    for pkg, folder in st["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([pkg, *rel.parts]))
    # a folder mapped on its own (pdpool.router -> router/) also appears under pdpool/ only if misplaced
    assert found - listed == set(), f"package folders missing from pyproject packages: {found - listed}"
    for pkg in listed:
        folder = _folder_of(pkg, st["package-dir"])
        if pkg in _data_packages(st):
            assert folder.is_dir() and not list(folder.glob("*.py")), f"{pkg}: a data folder holds no Python"
        else:
            assert (folder / "__init__.py").exists(), pkg


def _data_packages(st) -> set[str]:
    """Listed folders of C/C++ sources only (no ``__init__.py``), shipped as package data."""
    return {pkg for pkg in st["packages"] if not (_folder_of(pkg, st["package-dir"]) / "__init__.py").exists()
            and any(_folder_of(pkg, st["package-dir"]).glob("*.c*"))}


def test_operator_is_only_pdpool_operator():
    import operator

    assert hasattr(operator, "add"), "the stdlib operator module must stay importable"
    mod = importlib.import_module("pdpool.operator")
    assert pathlib.Path(mod.__file__).parent == ROOT / "operator"


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names in a non-editable wheel of the checkout (what ``pip install .`` in the image installs)."""
    # built from a copy of the checkout's files, so a stale build/ folder of the checkout cannot fill a gap
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
                             "pyproject.toml", "README.md", *set(_pyproject()["package-dir"].values())],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(source)], check=True, cwd=out)
    (wheel,) = out.glob("pdpool-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_non_editable_wheel_carries_every_subpackage(wheel_names):
    st = _pyproject()
    data = _data_packages(st)
    assert data == {"pdpool.csrc", "pdpool.kernels.csrc"}, data
    for pkg in st["packages"]:
        if pkg in data:
            assert any(n.startswith(f"{pkg.replace('.', '/')}/") for n in wheel_names), pkg
        else:
            assert f"{pkg.replace('.', '/')}/__init__.py" in wheel_names, pkg
    assert not any(n.startswith("operator/") for n in wheel_names), "operator/ must ship only as pdpool/operator"


def _tracked_data_files() -> dict[str, pathlib.Path]:
    """``{name in the wheel: path in the checkout}`` for every tracked file of a package folder that is not Python."""
    st = _pyproject()
    wanted = {}
    for pkg in st["packages"]:
        folder = _folder_of(pkg, st["package-dir"])
        listed = subprocess.run(["git", "ls-files", "--", "."], cwd=folder, capture_output=True, text=True,
                                check=True).stdout.split()
        for name in listed:
            path = folder / name
            if path.suffix in (".py", ".pyc") or (len(pathlib.Path(name).parts) > 1
                                                  and (folder / pathlib.Path(name).parts[0] / "__init__.py").exists()):
                continue   # code, or a file of a subpackage (counted under that one)
            wanted[f"{pkg.replace('.', '/')}/{name}"] = path
    return wanted


def test_the_wheel_carries_every_file_the_package_reads(wheel_names):
    """The native builders' sources and headers (the CPU kernel's header was left out of the wheel until
    2026-11-24, so ``pdpool build-kernels`` could not have built it in the image), the CRD's rendering, py.typed:
    every tracked non-Python file of a package folder is in the wheel under its import path."""
    from pdpool.kernels import build
    from pdpool import native_text as native

    wanted = _tracked_data_files()
    for source in [*build.SOURCES, *build.HEADERS, native.SOURCE]:
        assert source.resolve() in {p.resolve() for p in wanted.values()}, f"{source} is not tracked"
    missing = sorted(name for name in wanted if name not in wheel_names)
    assert not missing, f"not in the wheel (list them in [tool.setuptools.package-data]): {missing}"


def test_output_to_a_reader_that_left_ends_without_a_traceback():
    """`pdpool status | head -3` (here `pdpool operator crd`, 30 KB): once the reader has gone, a write to stdout is EPIPE (Python ignores SIGPIPE).
    It was a BrokenPipeError traceback on stderr; it ends quietly with 128 + SIGPIPE, as a shell tool does."""
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader has already left
    try:
        out = subprocess.run([sys.executable, "-m", "pdpool.cli", "operator", "crd"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert out.returncode == 128 + signal.SIGPIPE and out.stderr == "", (out.returncode, out.stderr)
