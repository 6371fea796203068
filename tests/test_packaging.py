"""Every install is the same harness: each package is discovered (setup.py), each data file is listed (pyproject.toml),
nothing generic lands at the top level of site-packages, and the repository carries no stray binaries.

CI (.ci/run) builds the wheel and runs `harness` from it in a fresh virtual environment; these tests find the cause of
a broken install in a second, in any clone.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MODELS_PACKAGE = "harness.models"  # where the models live (imported as MODELS_PACKAGE.torch_gpt, ...numpy_gpt)
BINARY_LIMIT = 100 * 1024
FIXTURES = ("tests/fixtures/", "julia/NanoGPTFlux/test/")  # test fixtures may be large


@pytest.fixture(scope="module")
def setup_args() -> dict:
    """The keyword arguments setup.py hands to setuptools.setup (found packages, package_dir), without building."""
    import setuptools

    captured: dict = {}
    saved = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)  # find_packages searches the current directory
        runpy.run_path(str(ROOT / "setup.py"))
    finally:
        os.chdir(cwd)
        setuptools.setup = saved
    return captured


def tracked_files() -> list[str]:
    """The repository's files: `git ls-files` in a clone, else every file outside caches and build outputs."""
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=30)
        if done.returncode == 0 and done.stdout:
            return [f for f in done.stdout.decode().split("\0") if f and (ROOT / f).is_file()]
    except OSError:
        pass
    skip = {".git", "__pycache__", "build", "dist", "reports", ".venv", ".pytest_cache", ".ruff_cache"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and not p.name.endswith(".egg-info")]


def package_dir(name: str, mapping: dict[str, str]) -> Path:
    """Where package `name` lives in the checkout (setup.py's package_dir, else its dotted path)."""
    for prefix in sorted(mapping, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return ROOT / mapping[prefix] / Path(*name[len(prefix):].lstrip(".").split(".") if name != prefix else ())
    return ROOT / Path(*name.split("."))


def test_every_python_directory_is_a_package(setup_args):
    packages = set(setup_args["packages"])
    dirs = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "harness").rglob("*.py")
            if "__pycache__" not in p.parts}
    assert dirs - packages == set(), "add an __init__.py: setup.py's find_packages skips directories without one"
    assert "harness.kit" in packages and "harness._julia" in packages


def test_nothing_generic_at_the_top_level(setup_args):
    tops = {p.split(".")[0] for p in setup_args["packages"]}
    assert tops == {"harness", MODELS_PACKAGE.split(".")[0]}, tops


def test_every_data_file_ships(setup_args):
    """Each non-Python file in a package's folder (configs, templates, juliapkg.json, NanoGPTFlux) matches a
    package-data glob in pyproject.toml, so a wheel has what a checkout has."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    mapping = setup_args.get("package_dir", {})
    shipped = set()
    for package, patterns in data.items():
        base = package_dir(package, mapping)
        for pattern in patterns:
            shipped |= {str(p.relative_to(ROOT)) for p in base.glob(pattern) if p.is_file()}
    roots = {str(package_dir(p, mapping).relative_to(ROOT)) for p in setup_args["packages"]}
    needed = {f for f in tracked_files() if not f.endswith(".py")
              and any(f.startswith(r + "/") for r in roots)}
    assert needed - shipped == set(), "list these in [tool.setuptools.package-data] of pyproject.toml"
    assert "julia/NanoGPTFlux/src/NanoGPTFlux.jl" in shipped and "harness/config/toml/small.toml" in shipped


def _is_binary(path: Path) -> bool:
    raw = path.read_bytes()
    if b"\0" in raw:
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_no_large_binaries_in_the_repository():
    large = [f for f in tracked_files() if not f.startswith(FIXTURES)
             and (ROOT / f).stat().st_size > BINARY_LIMIT and _is_binary(ROOT / f)]
    assert large == [], f"binary files over {BINARY_LIMIT // 1024} KB (a wheel? a dataset?): {large}"


def test_the_readme_set_up_is_what_ci_runs():
    """The README's install and test commands stay literally runnable: CI (.ci/run) runs the same ones (torch from
    the machine's local index instead of PyTorch's CPU index URL)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").replace(" --quiet", "")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    install, tests = blocks[0], next(b for b in blocks if b.strip().startswith("pytest"))
    commands = [line.split("#")[0].strip() for line in (install + tests).splitlines() if line.split("#")[0].strip()]
    assert commands[0] == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    for command in commands:
        command = command.replace(" --index-url https://download.pytorch.org/whl/cpu", "")
        assert re.search(rf"^(python3 -m )?{re.escape(command)}( |$)", ci, flags=re.M), f"CI does not run {command!r}"
