"""Every code folder is a subpackage of the one import package `pdpool`."""

import importlib
import pathlib
import tomllib

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
        assert (_folder_of(pkg, st["package-dir"]) / "__init__.py").exists(), pkg


def test_operator_is_only_pdpool_operator():
    import operator

    assert hasattr(operator, "add"), "the stdlib operator module must stay importable"
    mod = importlib.import_module("pdpool.operator")
    assert pathlib.Path(mod.__file__).parent == ROOT / "operator"


def test_non_editable_wheel_carries_every_subpackage(tmp_path):
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("pdpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in _pyproject()["packages"]:
        assert f"{pkg.replace('.', '/')}/__init__.py" in names, pkg
    assert not any(n.startswith("operator/") for n in names), "operator/ must ship only as pdpool/operator"
