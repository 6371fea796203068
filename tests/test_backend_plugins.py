"""Backends that declare themselves, and backends from outside the harness.

An installed distribution adds a backend through the entry-point group `harness.backends` (docs/backends.md): here a
distribution as pip would leave it (a module and a `.dist-info` with `entry_points.txt`) is put on sys.path, no pip.
It then runs through every command; one that cannot be used is refused in one line and the others keep working; and
no code in harness/ outside backends/ and models/ names a backend (the user-facing defaults live in
harness/backends/__init__.py).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from harness import backends
from harness.backends import PluginRefused
from harness.cli.main import build_parser, main
from tests.conftest import record_doc

ROOT = Path(__file__).resolve().parents[1]

NUMPY64 = '''
from harness.backends.numpy_backend import NumpyBackend


class Numpy64(NumpyBackend):
    """The NumPy oracle under another name, computing in float64 only."""

    name = "numpy64"
    declaration = NumpyBackend.declaration.replace(name="numpy64", dtypes=("float64",), color="", doctor="")
'''

BAD = '''
from harness.backends.numpy_backend import NumpyBackend


def function():
    """Not a class."""


class Float16(NumpyBackend):
    name = "float16"
    declaration = NumpyBackend.declaration.replace(name="float16", dtypes=("float16",))


class NoDeclaration:
    name = "nodecl"


class WrongName(NumpyBackend):
    name = "wrongname"
    declaration = NumpyBackend.declaration.replace(name="other")


class Plain(NumpyBackend):
    """Sound, but it declares no option and no gradients."""

    name = "plain"
    declaration = NumpyBackend.declaration.replace(name="plain", options=frozenset(), methods=frozenset(), doctor="")
'''


def install(site: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """What pip leaves in site-packages, written by hand: the modules and `<dist>-1.0.dist-info` with its
    METADATA and entry_points.txt (group harness.backends)."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[harness.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    for name, text in modules.items():
        (site / f"{name}.py").write_text(text)


def on_path(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`site` on this process's sys.path and on every child's PYTHONPATH; the registry reads the entry points anew."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    backends.reset()


@pytest.fixture
def numpy64(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = tmp_path / "site"
    install(site, "numpy64-plugin", {"numpy64": "numpy64_plugin:Numpy64"}, {"numpy64_plugin": NUMPY64})
    on_path(site, monkeypatch)
    yield site
    backends.reset()


@pytest.fixture
def bad_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = tmp_path / "bad-site"
    install(site, "bad-backends", {"broken": "broken_plugin:Broken", "notaclass": "bad_plugins:function",
                                   "float16": "bad_plugins:Float16", "nodecl": "bad_plugins:NoDeclaration",
                                   "wrongname": "bad_plugins:WrongName", "plain": "bad_plugins:Plain"},
            {"broken_plugin": "import a_framework_that_is_not_installed\n", "bad_plugins": BAD})
    install(site, "torch-again", {"torch": "bad_plugins:Plain"}, {})
    on_path(site, monkeypatch)
    yield site
    backends.reset()


def run_ids(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "runs").iterdir())


def test_a_backend_from_outside_runs_through_every_command(numpy64: Path, tmp_path: Path, config_file: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """A subclass of the NumPy backend under a new name, declaring float64 only, added through an entry point with no
    edit in harness/: run, parity (numpy the other side), bench overhead, a local sweep and report."""
    out, tiny = tmp_path / "out", str(config_file)
    assert main(["run", "--backend", "numpy64", "--config", tiny, "--steps", "3", "--no-text", "--no-report",
                 "--quiet", "--out", str(out)]) == 0
    (run_id,) = run_ids(out)
    record = record_doc(out / "runs" / run_id / "numpy64.json")
    assert record["status"] == "completed" and record["backend"] == "numpy64" and len(record["steps"]["loss"]) == 3

    assert main(["parity", "--backend", "numpy64,numpy", "--config", tiny, "--steps", "2", "--quiet",
                 "--out", str(out)]) == 0
    assert "PASS: numpy64 (float64) and numpy (float64)" in capsys.readouterr().out

    assert main(["bench", "overhead", "--backend", "numpy64", "--size", "small", "--timed-steps", "1", "--warmup",
                 "0", "--repeats", "1", "--quiet", "--out", str(out)]) == 0
    (bench,) = (out / "bench").glob("bench-*.json")
    assert [r["backend"] for r in json.loads(bench.read_text())["results"]] == ["numpy64"]

    assert main(["sweep", "--backend", "numpy64", "--config", tiny, "--steps", "2", "--paired-rounds", "0",
                 "--no-text", "--no-report", "--quiet", "--out", str(out)]) == 0
    (sweep_id,) = [p.name for p in (out / "sweeps").iterdir()]
    cells = json.loads((out / "sweeps" / sweep_id / "sweep.json").read_text())["cells"]
    assert [(c["backend"], c["status"]) for c in cells] == [("numpy64", "completed")]
    assert main(["report", run_id, "--out", str(out)]) == 0
    assert "numpy64" in (out / f"{run_id}.html").read_text()

    # float64 only: --dtype float32 is refused for it in one line, nothing written
    capsys.readouterr()
    assert main(["run", "--backend", "numpy64", "--dtype", "float32", "--config", tiny, "--out",
                 str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "harness: error: numpy64 backend: dtype must be one of float64, got 'float32'"
    assert not (tmp_path / "none").exists()


def test_a_backend_from_outside_is_listed_where_backends_are(numpy64: Path) -> None:
    """`--backend all`, `harness doctor` and every command's help name it; parity reads its dtype from its
    declaration."""
    from harness.cli.doctor import backend_rows
    from harness.cli.options import available_backends, pick_backends
    from harness.cli.parity import backend_dtype

    ready, _ = available_backends("cpu")
    assert "numpy64" in ready and "numpy" in ready
    assert pick_backends(["numpy64"]) == ["numpy64"]
    assert backend_rows("numpy64") == [("numpy64 backend (cpu)", "ready", "")]
    assert "backends: torch, numpy, flux, jax, numpy64, or all" in _help("run")
    assert backend_dtype("numpy64", None) == ("float64", {})


def test_a_backend_from_outside_times_its_parts_with_the_runner_it_declares(numpy64: Path) -> None:
    """`harness bench parts` asks the declaration, never a list of names: numpy64 inherits numpy's method `parts`
    and part runner, so it is supported and timed by the runner its declaration names."""
    from harness.backends import parts
    from harness.backends.numpy_parts import NumpyParts

    assert parts.supports("numpy64") and parts.runner_class("numpy64") is NumpyParts
    parts.check_supported(["numpy64", "numpy"])


def test_a_backend_from_outside_without_a_part_runner_is_refused_by_bench_parts(
        bad_plugins: Path, tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture) -> None:
    """"plain" declares no method `parts`: one line, exit 2, nothing written; `--backend all` leaves it out."""
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["bench", "parts", "--backend", "numpy,plain", "--config", str(config_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "backend 'plain' cannot time its parts" in err, err
    assert not out.exists()


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return " ".join(sub.choices[command].format_help().split())


def test_a_plugin_that_cannot_be_used_is_refused_in_one_line(bad_plugins: Path, tmp_path: Path, config_file: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Each is refused naming the plugin and what is wrong (it fails to import, names no class, declares nonsense,
    takes a shipped backend's name); the shipped backends keep working and the help still renders."""
    from harness.cli.options import available_backends, pick_backends

    expected = {"broken": "it failed to import (ModuleNotFoundError: No module named "
                          "'a_framework_that_is_not_installed')",
                "notaclass": "it names function", "float16": "its dtypes hold 'float16'",
                "nodecl": "its class has no `declaration`", "wrongname": "it declares the name 'other'",
                "torch": "its name clashes with the shipped backend 'torch'"}
    for name, why in expected.items():
        if name == "torch":
            assert backends.refusals()["torch"].startswith("backend plugin 'torch' (bad_plugins:Plain, from "
                                                           "torch-again 1.0) is refused: its name clashes")
            continue
        with pytest.raises(PluginRefused) as refused:
            backends.backend_class(name)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"backend plugin {name!r} (") and why in line, line
    ready, missing = available_backends("cpu")
    assert {"torch", "numpy", "plain"} <= set(ready) and set(expected) - {"torch"} <= set(missing)
    assert backends.backend_class("torch").__module__ == "harness.backends.torch_backend"  # never the clashing one
    assert pick_backends(["torch", "numpy"]) == ["torch", "numpy"]
    assert "backends: torch, numpy, flux, jax, plain, or all" in _help("run")

    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["run", "--backend", "float16", "--config", str(config_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "backend plugin 'float16'" in err and "Traceback" not in err, err
    assert not out.exists()


def test_what_a_backend_does_not_declare_is_refused_before_anything_is_written(bad_plugins: Path) -> None:
    """A config option it does not implement, and parity without the gradients it compares: one line each."""
    from harness.cli.parity import check_parity_methods
    from harness.errors import UsageError

    backends.check_backend("plain", "cpu", {}, {})
    with pytest.raises(UsageError, match="plain backend: it does not implement the config option tie_embeddings"):
        backends.check_backend("plain", "cpu", {}, {"tie_embeddings": True})
    with pytest.raises(UsageError, match="plain backend: parity compares step-0 gradients and it declares no "):
        check_parity_methods(["plain", "numpy"])


def test_the_shipped_declarations_are_sound_and_match_their_classes() -> None:
    """Every shipped backend declares a sound Declaration on its class and its options class, and has each method it
    declares (what a plugin is held to)."""
    for name in backends.REGISTRY:
        for cls in {backends.backend_class(name), backends.options_class(name)}:
            if cls is backends.backend_class(name):
                assert backends.plugin_problem(name, cls) is None, (name, backends.plugin_problem(name, cls))
            assert cls.declaration is backends.declaration(name) and not cls.declaration.problems()


def test_the_docs_table_is_what_the_shipped_backends_declare() -> None:
    """docs/backends.md's table of the shipped backends says what their declarations say (dtypes default first,
    devices, precisions, compile modes)."""
    rows = {}
    for line in (ROOT / "docs" / "backends.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].strip("`") in backends.REGISTRY:
            rows[cells[0].strip("`")] = [tuple(v for v in c.split(", ") if v) for c in cells[1:5]]
    assert rows == {name: [d.dtypes, d.devices, d.precisions, d.compile_modes]
                    for name, d in backends.declarations(list(backends.REGISTRY)).items()}


def test_entry_points_are_read_lazily_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the parser and naming shipped backends read no entry point; listing every backend reads them once."""
    import importlib.metadata

    calls = []
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: calls.append(kw) or real(**kw))
    backends.reset()
    build_parser()
    backends.check_names(["torch", "numpy", "jax", "flux"])
    assert calls == []
    backends.names()
    backends.names()
    backends.declarations()
    assert calls == [{"group": "harness.backends"}]
    backends.reset()


# --- no backend names outside backends/ and models/ -------------------------------------------------------------
# The few string literals equal to a backend's name that do not mean the backend, each in its one function: the
# NumPy and torch *libraries*' versions recorded in every run record's (and every bench record's) environment, and
# the report's column that shows NumPy's.
LIBRARIES = {("harness/environment.py", "capture", "numpy"), ("harness/report/tables.py", "environment_table", "numpy"),
             ("harness/bench/overhead.py", "bench_environment", "torch")}


def backend_literals(root: Path) -> list[str]:
    """`path:line: 'text'` for every string literal (f-string parts included, docstrings not) in root/harness/ outside
    backends/ and models/ that is a shipped backend's name, or names backends the way code chooses them: a list
    ("torch,numpy", "torch and flux"), a default or an example of --backend/--device ("default torch", "--device
    torch=cuda")."""
    import re

    names = "|".join(backends.REGISTRY)
    uses = re.compile(rf"^({names})$|\b({names}),\s*({names})\b|\b({names}) and ({names})\b"
                      rf"|(--backends?|default|add --backend|--device) ({names})\b")
    found = []
    for path in sorted((root / "harness").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("harness/backends/", "harness/models/")):
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        where = {id(node): f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(f)}  # the innermost function of each node (walked outermost first)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and uses.search(node.value) and (rel, where.get(id(node)), node.value) not in LIBRARIES):
                found.append(f"{rel}:{node.lineno}: {node.value[:80]!r}")
    return found


def test_no_code_outside_the_backends_names_a_backend() -> None:
    """What a backend can do is read from its declaration, and the user-facing defaults (--backend torch, --both,
    parity's pair, the oracle) are named once, in harness/backends/__init__.py."""
    assert backend_literals(ROOT) == []
