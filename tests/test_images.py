"""The two images, checked statically (no container engine here): docker/Dockerfile (engine and router) and
docker/Dockerfile.operator (slim, no torch).

Each Dockerfile is parsed as Docker reads it (line continuations, comment lines, exec-form JSON): every COPY source
exists and survives .dockerignore, the entrypoint runs a real ``pdpool`` subcommand (its ``--help`` parses with
the real CLI), the final user is non-root, and every base image is pinned by a tag. The operator image's entry runs
in a subprocess up to the point where it would connect, and must not have imported torch; every distribution it
did import must be in docker/operator-requirements.txt, with pyproject.toml's bounds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdpool import cli

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"engine": ROOT / "docker" / "Dockerfile", "operator": ROOT / "docker" / "Dockerfile.operator"}
OPERATOR_REQUIREMENTS = ROOT / "docker" / "operator-requirements.txt"
HEAVY = ("torch", "transformers", "triton", "safetensors", "numpy")


@dataclass
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """``["a", "b"]`` (JSON) or the shell form wrapped as Docker does."""
        text = self.args.strip()
        if text.startswith("["):
            return json.loads(text)
        return ["/bin/sh", "-c", text]

    def flags_and_words(self) -> tuple[dict[str, str], list[str]]:
        """``COPY --chown=1:1 --from=x a b`` -> ({"chown": "1:1", "from": "x"}, ["a", "b"])."""
        words = json.loads(self.args) if self.args.strip().startswith("[") else shlex.split(self.args)
        flags = {}
        while words and words[0].startswith("--"):
            key, _, value = words.pop(0)[2:].partition("=")
            flags[key] = value
        return flags, words


def parse_dockerfile(path: Path) -> list[Instruction]:
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments are dropped, also between continued lines
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends in a line continuation"
    return instructions


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """Instructions grouped by FROM; the leading group holds the global ARGs."""
    groups: list[list[Instruction]] = [[]]
    for ins in instructions:
        if ins.keyword == "FROM":
            groups.append([])
        groups[-1].append(ins)
    return groups


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    found = {}
    for ins in stages(instructions)[0]:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            found[name.strip()] = value.strip().strip('"')
    return found


def dockerignore_excludes(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (or something under it) out of the build context."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        candidates = prefixes + (["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
                                 if pattern.startswith("**/") else [])
        pat = pattern[3:] if pattern.startswith("**/") else pattern
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            excluded = not negate
    return excluded


def final_stage(name: str) -> list[Instruction]:
    return stages(parse_dockerfile(DOCKERFILES[name]))[-1]


def command_line(name: str) -> list[str]:
    """What the container runs by default: ENTRYPOINT + CMD of the final stage (the last of each wins)."""
    stage = final_stage(name)
    entry = [i for i in stage if i.keyword == "ENTRYPOINT"]
    cmd = [i for i in stage if i.keyword == "CMD"]
    assert entry, f"{name}: no ENTRYPOINT"
    return entry[-1].exec_form() + (cmd[-1].exec_form() if cmd else [])


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_every_copy_source_is_in_the_build_context(name):
    instructions = parse_dockerfile(DOCKERFILES[name])
    stage_names = {ins.args.split()[-1] for ins in instructions
                   if ins.keyword == "FROM" and " as " in ins.args.lower()}
    copies = 0
    for ins in instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        flags, words = ins.flags_and_words()
        if flags.get("from") in stage_names or "from" in flags:
            continue  # copied from another stage or image, not from the context
        assert len(words) >= 2, f"{name}: {ins.keyword} {ins.args!r} needs a source and a destination"
        for source in words[:-1]:
            assert not source.startswith(("/", "..")), f"{name}: {source} is outside the build context"
            assert (ROOT / source).exists(), f"{name}: COPY source {source} does not exist"
            assert not dockerignore_excludes(source.rstrip("/")), f"{name}: .dockerignore excludes {source}"
            copies += 1
    assert copies, f"{name}: copies nothing from the repository"


def test_the_package_folders_are_all_copied():
    """pyproject.toml maps import packages to folders; an image missing one would install a broken pdpool."""
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    for name in DOCKERFILES:
        copied = {source.rstrip("/") for ins in final_stage(name) if ins.keyword == "COPY"
                  for source in ins.flags_and_words()[1][:-1]}
        assert folders <= copied, f"{name}: package folders not copied: {sorted(folders - copied)}"
        assert {"pyproject.toml", "README.md"} <= copied, f"{name}: the build needs pyproject.toml and README.md"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_entrypoint_is_a_real_pdpool_subcommand(name):
    argv = command_line(name)
    assert argv[0] == "pdpool", f"{name}: the entrypoint runs {argv[0]!r}, not pdpool"
    subcommand = next((a for a in argv[1:] if not a.startswith("-")), None)
    assert subcommand in cli.COMMANDS, f"{name}: {subcommand!r} is not one of {sorted(cli.COMMANDS)}"
    # The real parser takes the subcommand: its --help exits 0 (and imports what that command imports).
    result = subprocess.run([sys.executable, "-c", "import sys; from pdpool.cli import main; sys.exit(main())",
                             subcommand, "--help"], cwd="/tmp", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"pdpool {subcommand}" in result.stdout


def test_the_operator_image_runs_pdpool_operator():
    assert command_line("operator")[:2] == ["pdpool", "operator"]
    assert command_line("engine")[0] == "pdpool"  # the chart passes `serve ...` or `router ...` as args


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_runs_as_a_non_root_user(name):
    instructions = parse_dockerfile(DOCKERFILES[name])
    users = [ins.args.split(":")[0].strip() for ins in final_stage(name) if ins.keyword == "USER"]
    assert users, f"{name}: no USER in the final stage: the container would run as root"
    user = users[-1]
    if user.isdigit():
        assert int(user) != 0, f"{name}: USER 0 is root"
        return
    assert user != "root", f"{name}: USER root"
    runs = " ".join(ins.args for ins in instructions if ins.keyword == "RUN")
    assert re.search(rf"\b(useradd|adduser)\b[^&;]*\b{re.escape(user)}\b", runs), \
        f"{name}: USER {user} is not created in the file"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_base_images_are_pinned_by_tag(name):
    instructions = parse_dockerfile(DOCKERFILES[name])
    args = global_args(instructions)
    stage_names: set[str] = set()
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    assert froms
    for ins in froms:
        words = [w for w in ins.args.split() if not w.startswith("--platform")]
        image = substitute(words[0], args)
        if len(words) == 3 and words[1].lower() == "as":
            stage_names.add(words[2])
        if image in stage_names or image == "scratch":
            continue
        assert "$" not in image, f"{name}: base image {words[0]} depends on an ARG without a default"
        if "@sha256:" in image:
            continue
        last = image.rsplit("/", 1)[-1]
        assert ":" in last, f"{name}: base image {image} has no tag"
        tag = last.split(":", 1)[1]
        assert tag and tag != "latest", f"{name}: base image {image} is not pinned (tag {tag!r})"
        assert re.search(r"\d", tag), f"{name}: base image tag {tag!r} names no version"


def test_the_engine_image_has_cuda_torch_and_nixl():
    text = " ".join(i.args for i in parse_dockerfile(DOCKERFILES["engine"]))
    base = substitute([i for i in parse_dockerfile(DOCKERFILES["engine"]) if i.keyword == "FROM"][-1].args.split()[0],
                      global_args(parse_dockerfile(DOCKERFILES["engine"])))
    assert base.startswith("nvidia/cuda:"), base
    assert "torch==" in text and "nixl-cu12" in text


def test_the_operator_image_installs_no_torch():
    runs = " ".join(i.args for i in parse_dockerfile(DOCKERFILES["operator"]) if i.keyword == "RUN")
    assert "--no-deps /src" in runs, "pdpool's base dependencies include torch: install it without them"
    names = {requirement_name(r) for r in requirement_lines(OPERATOR_REQUIREMENTS.read_text())}
    assert not names & {"torch", "transformers", "triton", "nixl-cu12", "accelerate"}, names


# ---- the operator entry, run for real ------------------------------------------------------------------------

ENTRY = """
import json, sys
import importlib.metadata as md
from pdpool.cli import main
outcome = "returned"
try:
    main(["operator", "--no-leader-election"])  # what the image's ENTRYPOINT runs; stops at the login
except BaseException as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
# what runs after the login: the chart's --pool-defaults file checked against the CRD schema, then the pure
# builders, as a reconcile runs them, on the CPU example pool
import yaml
from pdpool.operator.main import load_pool_defaults
load_pool_defaults(sys.argv[2])
from pdpool.operator.builders import render
from pdpool.operator.spec import parse_pool
body = yaml.safe_load(open(sys.argv[1]))
body["metadata"].update(namespace="default", uid="u-1", generation=1)
objects = render(parse_pool(body))
tops = {name.split(".")[0] for name in sys.modules}
owners = md.packages_distributions()
dists = sorted({d for top in tops for d in owners.get(top, [])})
print(json.dumps({"outcome": outcome, "modules": sorted(tops), "distributions": dists, "objects": len(objects)}))
"""


@pytest.fixture(scope="module")
def operator_entry(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    # no service account, no kubeconfig: the login is where it stops
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_") and k != "KUBECONFIG"}
    env["HOME"] = str(home)
    defaults = home / "pool-defaults.yaml"
    defaults.write_text("kvTransfer:\n  ucxTls: rc,cuda_copy,tcp\n  ucxNetDevices: mlx5_0:1\n")
    result = subprocess.run([sys.executable, "-c", ENTRY, str(ROOT / "examples" / "cpu-demo.yaml"), str(defaults)],
                            cwd="/tmp", env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pdpool_operator_imports_no_torch(operator_entry):
    assert "LoginError" in operator_entry["outcome"], operator_entry["outcome"]  # it got as far as connecting
    assert operator_entry["objects"] > 0
    leaked = [m for m in HEAVY if m in operator_entry["modules"]]
    assert not leaked, f"`pdpool operator` imported {leaked}"


def requirement_lines(text: str) -> list[str]:
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_operator_requirements_cover_its_imports_with_pyprojects_bounds(operator_entry):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {requirement_name(r): r for r in project["dependencies"] + project["optional-dependencies"]["operator"]}
    listed = {requirement_name(r): r for r in requirement_lines(OPERATOR_REQUIREMENTS.read_text())}
    for name, requirement in listed.items():
        assert name in declared, f"{name} is in operator-requirements.txt but not a pdpool dependency"
        assert requirement.replace(" ", "") == declared[name].split(";")[0].replace(" ", ""), \
            f"{requirement!r} differs from pyproject.toml's {declared[name]!r}"
    assert set(project["optional-dependencies"]["operator"]) <= set(listed.values())
    imported_direct = {requirement_name(d) for d in operator_entry["distributions"]} & set(declared)
    missing = imported_direct - set(listed)
    assert not missing, f"`pdpool operator` imports {sorted(missing)}, which the operator image would not install"
