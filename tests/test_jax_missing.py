"""Without JAX: `--backend jax` is one line naming the install command (exit 2, nothing written), `--backend all`
leaves jax out and says why, and importing the harness never imports JAX. JAX is hidden from a fresh interpreter by a
sys.meta_path finder, whether or not it is installed here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import data_path, tree

# a fresh interpreter in which `import jax` fails as if JAX were not installed, then `harness ARGS`
HIDDEN = """
import importlib.abc, sys
class NoJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jax" or name.startswith(("jax.", "jaxlib")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoJax())
from harness.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def hidden(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HARNESS_DATA=str(data_path()))
    return subprocess.run([sys.executable, "-c", HIDDEN, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("command", [["run", "--backend", "jax", "--steps", "2"],
                                     ["run", "--backend", "torch,jax", "--steps", "2"],
                                     ["parity", "--backend", "jax,numpy", "--steps", "2"]])
def test_backend_jax_without_jax_is_one_line_naming_the_install(command: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = hidden(*command, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "jax backend: JAX is not installed" in proc.stderr and "pip install -e '.[jax]'" in proc.stderr
    assert tree(out) == []  # nothing written


def test_backend_all_leaves_jax_out_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends import jax_backend
    from harness.cli.options import available_backends

    monkeypatch.setattr(jax_backend, "installed", lambda module: False)
    ready, missing = available_backends("cpu")
    assert "jax" not in ready and "numpy" in ready
    assert missing["jax"].startswith("jax backend: JAX is not installed; pip install -e '.[jax]'")


def test_importing_the_harness_never_imports_jax() -> None:
    code = ("import sys, harness, harness.cli.main, harness.backends.jax_backend, harness.cli.doctor; "
            "from harness.cli.options import available_backends; available_backends('cpu'); "
            "from harness.cli.parity import backend_dtype; backend_dtype('jax', None); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); "
            "sys.exit(f'imported {bad}') if bad else None")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_doctor_row_without_jax_or_with_a_broken_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends import jax_options

    monkeypatch.setattr(jax_options, "installed", lambda module: False)
    assert jax_options.jax_row() == ("jax", "not installed",
                                     "only needed for --backend jax: pip install -e '.[jax]' (or pip install jax)")
    monkeypatch.setattr(jax_options, "installed", lambda module: True)
    monkeypatch.setattr(jax_options, "JAX_PROBE", "import sys; sys.exit('RuntimeError: no backend could be "
                        "initialised')")
    _, status, fix = jax_options.jax_row()
    assert status == "broken (RuntimeError: no backend could be initialised)" and fix.startswith("reinstall jax")


def test_reports_draw_jax_in_a_colour_no_other_backend_gets() -> None:
    """jax has its own colour in every figure, the one it declares; a backend the report does not know (a port's
    name) never gets a shipped backend's colour."""
    from harness.backends import declarations
    from harness.report import figures

    shipped = {name: d.color for name, d in declarations().items()}
    assert figures.color("jax") == shipped["jax"]
    assert len(set(shipped.values())) == len(shipped)
    assert not {figures.color(name) for name in ("mxnet", "tinygrad", "port", "x")} & set(shipped.values())
