"""Preflight: what this machine has for the checks, found in seconds before anything is timed.

One line per part: the GPU and its CUDA version (nvidia-smi), a CUDA build of torch that sees it, a C compiler and
Python's headers for Triton (the compile checks), a CuPy that runs on this CUDA (the `cuda` extra pins cupy-cuda12x;
a CUDA 13 driver wants cupy-cuda13x), JAX's CUDA plugin, NVML (nvidia-ml-py: the GPU's contention evidence), the data
file, the nanoGPT checkout, and the harness's own dependencies. A missing part names the checks it skips; each of
those gets a row "skipped: needs …" in the summary, never silently dropped.

This process never imports torch, CuPy or JAX (it would hold a CUDA context and be "another process on the GPU" in
every paired timing's evidence): a child interpreter answers (`PROBE`), and CuPy's readiness is the harness's own
check (harness.backends.numpy_backend.cupy_ready_in_child), in a child too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck import nanogpt

ROOT = Path(__file__).resolve().parents[2]
# what each part is, and the fix when it is missing (docs/benchmarks.md, "What to carry to a GPU machine")
PARTS = {
    "harness": ("the harness's dependencies", "install the carried wheels: python tools/gpu_carry.py install"),
    "cuda": ("a GPU and a CUDA build of torch", "a CUDA build of torch (pip download torch --index-url "
                                                "https://download.pytorch.org/whl/cu128 or cu130) and a driver"),
    "cupy": ("CuPy for this CUDA (the oracle on the GPU)", "carry the CuPy of the driver's CUDA major: cupy-cuda12x "
                                                           "or cupy-cuda13x"),
    "compiler": ("a C compiler and Python's headers for Triton", "apt install gcc python3-dev (or set CC)"),
    "jax-cuda": ("JAX with its CUDA plugin", "carry jax[cuda12] or jax[cuda13] (hundreds of MB of wheels)"),
    "nvml": ("NVML (nvidia-ml-py)", "carry nvidia-ml-py"),
    "nanogpt": ("a nanoGPT checkout (--nanogpt)", "pass --nanogpt PATH: a checkout of karpathy/nanoGPT"),
}
REQUIRED = {"harness", "cuda"}  # without these the GPU plan cannot run at all (a dry run needs "harness" only)
# the harness's dependencies as modules (pyproject.toml's list, by import name); juliacall and submitit serve flux
# and SLURM only, which the GPU check does not run
MODULES = ("numpy", "scipy", "torch", "tqdm", "platformdirs", "sacrebleu", "jinja2", "matplotlib", "pandas",
           "jsonschema")
OPTIONAL_MODULES = ("juliacall", "submitit")
PROBE = r"""
import importlib, importlib.util, json, sys
out = {"missing": {}, "optional_missing": {}}
for name in MODULES:
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["missing"][name] = f"{type(exc).__name__}: {exc}"[:200]
for name in OPTIONAL:  # found, not imported (importing juliacall looks for Julia)
    if importlib.util.find_spec(name) is None:
        out["optional_missing"][name] = "not installed"
try:
    import torch
    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                    "available": torch.cuda.is_available() if torch.version.cuda else False}
    if out["torch"]["available"]:
        out["torch"]["device"] = torch.cuda.get_device_name(0)
except Exception as exc:
    out["torch"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
try:
    import pynvml
    pynvml.nvmlInit()
    out["nvml"] = {"driver": str(pynvml.nvmlSystemGetDriverVersion()), "gpus": pynvml.nvmlDeviceGetCount()}
except Exception as exc:
    out["nvml"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
print(json.dumps(out))
"""


@dataclass
class Part:
    """One line of the preflight: the part, whether it is there, what was found, the fix."""

    name: str
    ok: bool
    status: str
    fix: str = ""

    def line(self, skips: list[str], needed: bool, narrows: Sequence[str] = ()) -> str:
        what = PARTS.get(self.name, (self.name, ""))[0]
        if self.ok:
            return f"  ok       {what}: {self.status}"
        if not needed:
            return f"  -        {what}: {self.status} (no check of this plan needs it)"
        without = f"; runs {', '.join(narrows)}" if narrows else ""
        return f"  MISSING  {what}: {self.status}; skips {', '.join(skips) or 'nothing'}{without}; fix: {self.fix}"


def probe(timeout_s: float = 180) -> dict[str, Any]:
    """The child's answers (modules, torch, NVML), or {"error": ...} when it could not run."""
    code = f"MODULES = {MODULES!r}\nOPTIONAL = {OPTIONAL_MODULES!r}\n{PROBE}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": f"the probe failed: {type(exc).__name__}: {exc}"[:300]}


def nvidia_smi() -> tuple[str | None, str | None]:
    """(the GPU's name and driver, the driver's CUDA version) from nvidia-smi, or Nones."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, None
    try:
        header = subprocess.run([smi], capture_output=True, text=True, timeout=15).stdout
        gpu = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, None
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return (gpu[0].strip() if gpu else None), (cuda[1] if cuda else None)


def compiler_part() -> Part:
    """What Triton needs to build its launcher: CC, else gcc, else clang (its own order), Python's headers (the
    include directory of sysconfig's default scheme, posix_local read as posix_prefix) and Triton itself."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    scheme = sysconfig.get_default_scheme() if hasattr(sysconfig, "get_default_scheme") else "posix_prefix"
    include = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])
    triton = _version("triton")
    missing = [w for w, ok in (("a C compiler", cc), (f"Python.h in {include}", (include / "Python.h").is_file()),
                               ("triton", triton)) if not ok]
    status = f"{cc or 'no compiler'}, {include / 'Python.h'}, triton {triton or 'missing'}"
    return Part("compiler", not missing, status if not missing else f"no {', no '.join(missing)}",
                PARTS["compiler"][1] + ("" if triton else "; triton comes with CUDA builds of torch"))


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def cupy_part(gpu: str | None, cuda: str | None) -> Part:
    """CuPy installed for this driver's CUDA major and able to run what the numpy backend needs (its readiness
    check: a compiled kernel, a float64 matmul, scatter_add), in a child."""
    dists = [d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy") if _version(d)]
    if not dists:
        return Part("cupy", False, "not installed", PARTS["cupy"][1])
    name = f"{dists[0]} {_version(dists[0])}"
    if gpu is None:
        return Part("cupy", False, f"{name}, but no GPU", PARTS["cuda"][1])
    sys.path.insert(0, str(ROOT))
    from harness.backends.base import BackendUnavailable
    from harness.backends.numpy_backend import cupy_ready_in_child

    try:
        cupy_ready_in_child(timeout_s=120)
    except BackendUnavailable as exc:
        major = (cuda or "?").split(".")[0]
        return Part("cupy", False, f"{name} not ready on CUDA {cuda}: {str(exc)[:200]}",
                    f"carry cupy-cuda{major}x for this CUDA {major} driver")
    return Part("cupy", True, f"{name}, ready on CUDA {cuda} (kernel, float64 matmul, scatter_add ran)")


def jax_part(gpu: str | None) -> Part:
    """JAX's CUDA plugin (the jax backend's own check, import-free) and, with a GPU, JAX listing it (a child)."""
    sys.path.insert(0, str(ROOT))
    from harness.backends.base import BackendUnavailable
    from harness.backends.jax_backend import JaxBackend

    try:
        JaxBackend.check_available("cuda")
    except BackendUnavailable as exc:
        return Part("jax-cuda", False, str(exc).removeprefix("jax backend: ")[:200], PARTS["jax-cuda"][1])
    if gpu is None:
        return Part("jax-cuda", False, "the plugin is installed, but there is no GPU", PARTS["cuda"][1])
    code = "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        ok = done.returncode == 0 and done.stdout.strip() not in ("", "0")
    except (OSError, subprocess.SubprocessError):
        ok = False
    return Part("jax-cuda", ok, f"JAX {_version('jax')} sees the GPU" if ok else "JAX's plugin finds no GPU",
                PARTS["jax-cuda"][1])


def harness_part(found: dict[str, Any]) -> Part:
    if "error" in found:
        return Part("harness", False, found["error"], PARTS["harness"][1])
    missing = found.get("missing") or {}
    optional = ", ".join(found.get("optional_missing") or {})
    status = "every dependency imports" + (f" (not {optional}: flux and SLURM only)" if optional else "")
    return Part("harness", not missing, status if not missing else "cannot import " + "; ".join(
        f"{k} ({v})" for k, v in missing.items()), PARTS["harness"][1])


def cuda_part(found: dict[str, Any], gpu: str | None, cuda: str | None) -> Part:
    t = found.get("torch") or {}
    if gpu is None:
        return Part("cuda", False, "no GPU (nvidia-smi missing or silent)", PARTS["cuda"][1])
    if not t.get("cuda"):
        return Part("cuda", False, f"GPU {gpu}, CUDA {cuda}, but torch {t.get('version', '?')} is a CPU build"
                    + (f" ({t['error']})" if t.get("error") else ""), PARTS["cuda"][1])
    if not t.get("available"):
        return Part("cuda", False, f"torch {t['version']} (CUDA {t['cuda']}) sees no GPU; the driver's CUDA is "
                    f"{cuda}", "a torch built for a CUDA the driver supports")
    return Part("cuda", True, f"{gpu}, driver CUDA {cuda}; torch {t['version']} (CUDA {t['cuda']}) sees "
                f"{t.get('device')}")


def nvml_part(found: dict[str, Any]) -> Part:
    n = found.get("nvml") or {}
    if "error" in n:
        return Part("nvml", False, f"{n['error']} (the paired timings then judge the host side only)",
                    PARTS["nvml"][1])
    return Part("nvml", True, f"driver {n.get('driver')}, {n.get('gpus')} GPU(s)")


def data_part(data: Path) -> Part:
    """The data file (the CLI has checked that it is a file): Tiny Shakespeare, or not (the recipe's targets are
    Tiny Shakespeare's)."""
    sys.path.insert(0, str(ROOT))
    from harness.core.data import TINY_SHAKESPEARE_SHA256

    tiny = hashlib.sha256(data.read_bytes()).hexdigest() == TINY_SHAKESPEARE_SHA256
    return Part("data", True, f"{data}" + (" (Tiny Shakespeare)" if tiny else " (not Tiny Shakespeare: the recipe's "
                                                                                 "targets do not apply)"))


def nanogpt_part(checkout: Path | None) -> Part:
    if checkout is None:
        return Part("nanogpt", False, "none given", PARTS["nanogpt"][1])
    missing = nanogpt.missing_files(checkout)
    return Part("nanogpt", not missing, f"{checkout}" + (f" lacks {', '.join(missing)}" if missing else ""),
                PARTS["nanogpt"][1])


def find_parts(args: Any, needed: set[str]) -> tuple[list[Part], dict[str, Any]]:
    """Every part, in PARTS' order, and the probe's answers; the slow ones (CuPy's kernels, JAX's devices) only
    where a check needs them."""
    found = probe()
    gpu, cuda = nvidia_smi()
    harness = harness_part(found)
    parts = [harness, cuda_part(found, gpu, cuda)]
    usable = harness.ok  # CuPy's and JAX's checks import the harness
    parts.append(cupy_part(gpu, cuda) if usable and "cupy" in needed else Part("cupy", False, "not checked"))
    parts.append(compiler_part())
    parts.append(jax_part(gpu) if usable and "jax-cuda" in needed else Part("jax-cuda", False, "not checked"))
    parts += [nvml_part(found), nanogpt_part(getattr(args, "nanogpt", None))]
    if usable:
        parts.append(data_part(Path(args.data)))
    t = found.get("torch") or {}
    found["environment"] = (f"Python {sys.version.split()[0]}, torch {t.get('version', '?')}, CUDA "
                            f"{t.get('cuda') or 'none'}, {t.get('device') or gpu or 'no GPU'}")
    return parts, found


def preflight(args: Any, checks: list[Any]) -> tuple[bool, str, dict, list[str]]:
    """(passed, summary, figures, console lines): the parts, each missing one with the checks it skips. Fails only
    when a part every check needs is missing (the harness's dependencies; on a GPU, CUDA)."""
    needed = set().union(*(c.needs for c in checks))
    parts, found = find_parts(args, needed)
    lines, missing = [], []
    for p in parts:
        skips = [c.name for c in checks if p.name in c.needs and p.name not in c.optional]
        narrows = [f"{c.name} without {c.optional[p.name]}" for c in checks if p.name in c.optional]
        lines.append(p.line(skips, p.name in needed, narrows))
        if not p.ok and p.name in needed:
            missing.append(p.name)
    required = REQUIRED & needed
    ok = not (required & set(missing))
    figures = {"parts": {p.name: {"ok": p.ok, "status": p.status, "fix": p.fix} for p in parts}, "missing": missing,
               "environment": found["environment"]}
    summary = ("every part found" if not missing else
               f"missing {', '.join(missing)}: "
               f"{sum(bool((set(missing) & c.needs) - set(c.optional)) for c in checks)} checks skipped")
    return ok, summary, figures, lines
