"""The flux backend where Julia cannot run: fast, one-line refusals that write nothing.

Most tests simulate the situation (no Julia on PATH, no juliaup, an empty juliapkg project, no network) so they
mean the same thing on a machine that has Julia; the last ones use the real environment and skip where Julia
(or a network to install it) is present.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from harness.backends import flux
from harness.backends.base import BackendUnavailable
from tests.conftest import run_cli


@pytest.fixture
def no_julia(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An environment with no Julia anywhere and no network; returns a directory that must stay empty."""
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    for var in ("PYTHON_JULIAPKG_EXE", "PYTHON_JULIACALL_EXE", "PYTHON_JULIACALL_PROJECT", "PYTHON_JULIAPKG_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setenv("JULIAUP_DEPOT_PATH", str(sandbox / "juliaup-depot"))
    project = sandbox / "project"
    monkeypatch.setattr(flux, "_juliapkg_state", lambda: {
        "project": str(project), "meta": str(project / "pyjuliapkg" / "meta.json"),
        "install": str(project / "pyjuliapkg" / "install"), "offline": False})
    monkeypatch.setattr(flux, "network_reachable", lambda *a, **k: False)
    return sandbox


def _fake_julia(directory: Path, version: str = "1.10.4") -> Path:
    exe = directory / "julia"
    exe.write_text(f"#!/bin/sh\necho 'julia version {version}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _refusal(device: str = "cpu") -> str:
    t0 = time.perf_counter()
    with pytest.raises(BackendUnavailable) as info:
        flux.FluxBackend.check_available(device)
    assert time.perf_counter() - t0 < 10
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("flux backend:")
    return message


def test_no_julia_no_network(no_julia: Path):
    message = _refusal()
    assert "no Julia found and no network" in message
    assert "PYTHON_JULIAPKG_EXE" in message and "harness setup julia" in message
    assert not any(no_julia.iterdir()), "check_available wrote files"


def test_no_julia_offline(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    state = flux._juliapkg_state()
    monkeypatch.setattr(flux, "_juliapkg_state", lambda: {**state, "offline": True})
    assert "PYTHON_JULIAPKG_OFFLINE" in _refusal()


def test_no_julia_but_network_is_available(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(flux, "network_reachable", lambda *a, **k: True)
    flux.FluxBackend.check_available("cpu")  # juliapkg would download Julia on first use
    assert not any(no_julia.iterdir())


def test_juliacall_missing(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    real = flux.importlib.util.find_spec
    monkeypatch.setattr(flux.importlib.util, "find_spec",
                        lambda name, *a: None if name == "juliacall" else real(name, *a))
    assert "pip install juliacall" in _refusal()


def test_a_missing_dependency_of_juliapkg_is_named(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    """juliapkg importable but its own dependency (tomlkit) missing, as on the first GPU machine: the refusal names
    the module and the pip command. Planted bug: the old message blamed PYTHON_JULIAPKG_PROJECT."""
    import sys

    monkeypatch.setattr(flux, "_juliapkg_state", lambda: None)  # what the real one returns when the import fails
    for name in [m for m in sys.modules if m == "juliapkg" or m.startswith("juliapkg.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tomlkit", None)  # hidden: `import tomlkit` raises ModuleNotFoundError
    message = _refusal()
    assert "'tomlkit'" in message and "pip install tomlkit" in message and "PYTHON_JULIAPKG_PROJECT" not in message


def test_exe_override_points_nowhere(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHON_JULIAPKG_EXE", str(no_julia / "missing-julia"))
    assert "PYTHON_JULIAPKG_EXE" in _refusal()


def test_julia_found_but_packages_missing_offline(no_julia: Path):
    _fake_julia(Path(os.environ["PATH"]))
    message = _refusal()
    assert "not installed" in message and "harness setup julia" in message


def test_julia_found_and_environment_installed(no_julia: Path):
    _fake_julia(Path(os.environ["PATH"]))
    meta = Path(flux._juliapkg_state()["meta"])
    meta.parent.mkdir(parents=True)
    meta.write_text('{"meta_version": 8, "pkgs": [{"name": "NanoGPTFlux"}]}')
    flux.FluxBackend.check_available("cpu")
    status = flux.julia_status(probe_network=False)
    assert status["julia_version"] == "1.10.4" and status["julia_source"] == "PATH"
    assert status["resolved"] and status["package_registered"]


def test_old_julia_without_network(no_julia: Path):
    _fake_julia(Path(os.environ["PATH"]), version="1.9.4")
    assert "older than 1.10" in _refusal()


def test_cuda_without_driver(no_julia: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(flux, "gpu_seen", lambda: False)
    assert _refusal("cuda").endswith("there is no NVIDIA GPU here (no driver, no nvidia-smi): use --device cpu")


def test_only_float32():
    with pytest.raises(BackendUnavailable, match="float32"):
        flux.FluxBackend(dtype="float64")
    with pytest.raises(BackendUnavailable, match="tf32"):
        flux.FluxBackend(precision="bf16")
    assert flux.FluxBackend(precision="tf32").tf32
    assert not flux.FluxBackend().tf32


def test_flux_worker_imports_neither_torch_nor_juliacall():
    """juliacall must be imported before torch: the flux worker's imports must not pull torch in, and only
    FluxBackend.setup imports juliacall."""
    import subprocess
    import sys

    code = ("import sys, harness.run.worker, harness.backends.flux; "
            "assert 'torch' not in sys.modules and 'juliacall' not in sys.modules, sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _real_refusal() -> str:
    exe, _ = flux.find_julia()
    if exe is not None:
        pytest.skip(f"Julia is installed here ({exe}): the real no-Julia path cannot be exercised")
    reason = flux.unavailable_reason("cpu")
    if reason is None:
        pytest.skip("no Julia here, but a network to download one: the flux backend is available")
    return reason


def test_real_environment_refuses_quickly():
    _real_refusal()
    message = _refusal()
    assert "harness setup julia" in message or "pip install juliacall" in message


def test_cli_run_flux_exits_2_and_writes_nothing(tmp_path: Path):
    _real_refusal()
    out = tmp_path / "out"
    t0 = time.perf_counter()
    result = run_cli("run", "--backend", "flux", "--steps", "5", "--out", str(out), timeout=120)
    assert time.perf_counter() - t0 < 60
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "flux backend:" in lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_cli_setup_julia_exits_2(tmp_path: Path):
    _real_refusal()
    result = run_cli("setup", "julia", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "flux backend:" in result.stderr


def test_doctor_reports_and_returns_0():
    result = run_cli("doctor", timeout=120)
    assert result.returncode == 0, result.stderr
    for row in ("Python", "torch", "juliacall", "Julia executable", "GPU (nvidia-smi)", "flux backend (cpu)"):
        assert row in result.stdout
