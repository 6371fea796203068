"""`harness doctor` (what is installed, what is missing, how to fix it) and `harness setup julia`.

`doctor` never starts Julia and never installs anything: it reads versions from package metadata, the Julia
environment's Manifest.toml and `nvidia-smi`. What it checks per backend is the backend's own (its declaration's
`doctor` hook: harness.backends.torch_options, numpy_backend, jax_options, flux_setup, or a plugin's). The set-up
itself is harness.backends.flux_setup.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import shutil
import subprocess
import sys


# --- doctor / setup ----------------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.cli.doctor import doctor

    return doctor()


def cmd_setup(args: argparse.Namespace) -> int:
    from harness.backends.flux_setup import setup_julia

    return setup_julia(force=args.force)


def _gpu_row() -> tuple[str, str, str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ("GPU (nvidia-smi)", "none found", "only needed for --device cuda")
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return ("GPU (nvidia-smi)", f"nvidia-smi failed ({type(exc).__name__})", "check the NVIDIA driver")
    return ("GPU (nvidia-smi)", "; ".join(line.strip() for line in out.splitlines()) or "no GPU listed",
            "" if out else "check the NVIDIA driver")


def backend_rows(name: str) -> list[tuple[str, str, str]]:
    """Backend `name`'s rows: what its declaration's doctor hook reports (its framework, its tools), then whether it
    can run on the CPU here (a plugin that is refused: why)."""
    from harness.backends import BackendUnavailable, PluginRefused, options_class

    try:
        cls = options_class(name)
    except PluginRefused as exc:
        return [(f"{name} backend", "refused", str(exc))]
    decl = cls.declaration
    out: list[tuple[str, str, str]] = []
    if decl.doctor:
        module, _, attr = decl.doctor.partition(":")
        try:
            out += [tuple(map(str, row)) for row in getattr(importlib.import_module(module), attr)()]
        except Exception as exc:  # a plugin's hook that fails is reported, never raised
            out.append((f"{name} backend", f"its doctor rows failed ({type(exc).__name__}: {exc})"[:160],
                        "fix the backend's doctor hook"))
    try:
        cls.check_available("cpu")
        out.append((f"{name} backend (cpu)", "ready", ""))
    except (BackendUnavailable, ImportError) as exc:
        out.append((f"{name} backend (cpu)", "unavailable", str(exc).splitlines()[0] if str(exc) else
                    (f"{decl.needs}: {decl.install}" if decl.install else type(exc).__name__)))
    except Exception as exc:  # a backend's check that breaks is reported, never raised
        out.append((f"{name} backend (cpu)", f"its check failed ({type(exc).__name__})", str(exc)[:160]))
    return out


def rows() -> list[tuple[str, str, str]]:
    """(component, status, fix) for everything the harness can use, backend by backend (each backend's
    declaration says what to check); fix is "" when nothing is to be done."""
    from harness.backends import names, refusals

    out: list[tuple[str, str, str]] = [("Python", f"{platform.python_version()} ({sys.executable})", ""), _gpu_row()]
    for name in names():
        out += backend_rows(name)
    out += [(f"{name} backend", "refused", why) for name, why in refusals().items() if name not in names()]
    return out


def _print_table(table: list[tuple[str, str, str]]) -> None:
    """The rows in three columns that line up (harness.units.text_table: a long status wraps within its column)."""
    from harness.units import text_table

    print(text_table(("component", "status", "fix"), table))


def doctor() -> int:
    """Print what is installed and how to fix what is missing; always 0 (it is a report, not a check)."""
    _print_table(rows())
    return 0
