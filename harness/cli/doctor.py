"""`harness doctor` (what is installed, what is missing, how to fix it) and `harness setup julia`.

`doctor` never starts Julia and never installs anything: it reads versions from package metadata, the Julia
environment's Manifest.toml and `nvidia-smi`. The set-up itself is harness.backends.flux_setup.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

from harness.backends.flux_setup import JULIA_PACKAGES


# --- doctor / setup ----------------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.cli.doctor import doctor

    return doctor()


def cmd_setup(args: argparse.Namespace) -> int:
    from harness.backends.flux_setup import setup_julia

    return setup_julia(force=args.force)


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed
        return None


def _torch_row() -> tuple[str, str, str]:
    """torch's version and whether --device cuda can work: a CPU-only build (torch.version.cuda is None) needs a
    CUDA build; a CUDA build that sees no GPU has a driver or device problem."""
    if importlib.util.find_spec("torch") is None:
        return ("torch", "missing", "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                                    "(or a CUDA build for --device cuda)")
    try:
        import torch

        built = getattr(torch.version, "cuda", None)
        if built is None:
            gpu_here = shutil.which("nvidia-smi") is not None
            return ("torch", f"{torch.__version__}, CPU-only build (no CUDA)",
                    "a GPU is present: install a CUDA build of torch for --device cuda" if gpu_here else "")
        if not torch.cuda.is_available():
            return ("torch", f"{torch.__version__}, CUDA {built} build, but no usable GPU",
                    "the driver or the device is the problem: check `nvidia-smi` (a driver recent enough for "
                    f"CUDA {built}) and CUDA_VISIBLE_DEVICES")
        cap = torch.cuda.get_device_capability(0)
        return ("torch", f"{torch.__version__}, CUDA {built}: {torch.cuda.get_device_name(0)} "
                         f"(compute capability {cap[0]}.{cap[1]})",
                "" if tuple(cap) >= (8, 0) else "pre-Ampere GPU: --precision tf32/bf16 are refused, fp32 only")
    except Exception as exc:  # a broken install is reported, not raised
        return ("torch", f"broken ({type(exc).__name__}: {exc})", "reinstall torch")


# run in a child interpreter: doctor's own process never starts JAX (nor, on a GPU, a CUDA context of JAX's)
JAX_PROBE = ("import jax, jaxlib; print(jax.__version__, jaxlib.__version__); "
             "print('; '.join(f'{d.platform} {d.id}' + ('' if d.device_kind == d.platform else f' ({d.device_kind})') "
             "for d in jax.devices()))")


def _jax_row() -> tuple[str, str, str]:
    """JAX (the jax backend): its version and the devices it sees, asked of a child interpreter; on a machine with
    an NVIDIA GPU, whether JAX sees it (its CUDA plugin)."""
    from harness.backends.jax_backend import CUDA_INSTALL, INSTALL, installed

    if not installed("jax"):
        return ("jax", "not installed", f"only needed for --backend jax: {INSTALL}")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        proc = subprocess.run([sys.executable, "-c", JAX_PROBE], capture_output=True, text=True, timeout=120,
                              env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return ("jax", f"installed, but starting it failed ({type(exc).__name__})", f"reinstall jax: {INSTALL}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) < 2:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return ("jax", f"broken ({last})", f"reinstall jax: {INSTALL}")
    jax_version, _, jaxlib_version = lines[0].partition(" ")
    devices = lines[1]
    status = f"{jax_version} (jaxlib {jaxlib_version}), devices: {devices}"
    gpu_missing = shutil.which("nvidia-smi") is not None and "gpu" not in devices
    return ("jax", status, f"a GPU is present but JAX does not see it: for --device cuda {CUDA_INSTALL}"
            if gpu_missing else "")


def _cupy_row() -> tuple[str, str, str]:
    """CuPy (the numpy backend on --device cuda): installed, and able to compile and run what the backend needs."""
    if importlib.util.find_spec("cupy") is None:
        return ("CuPy (numpy backend on cuda)", "not installed",
                "only needed for --backend numpy --device cuda: pip install 'cupy-cuda12x[ctk]'")
    from harness.backends.base import BackendUnavailable
    from harness.backends.numpy_backend import NumpyBackend

    version = _dist_version("cupy") or next((v for v in (_dist_version("cupy-cuda12x"),
                                                          _dist_version("cupy-cuda13x")) if v), "?")
    try:
        NumpyBackend.check_available("cuda")
    except BackendUnavailable as exc:
        return ("CuPy (numpy backend on cuda)", f"{version}, not ready", str(exc).removeprefix("numpy backend: "))
    except Exception as exc:  # a broken install is reported, not raised
        return ("CuPy (numpy backend on cuda)", f"{version}, broken ({type(exc).__name__})", "reinstall CuPy")
    return ("CuPy (numpy backend on cuda)", f"{version}, ready (kernel, float64 matmul, scatter_add ran)", "")


def _compile_row() -> tuple[str, str, str]:
    """What `--compile` needs: torch's Inductor compiles generated C++ (CPU) with a C/C++ compiler, and on CUDA
    Triton, which also builds a small C helper at first use."""
    import os

    compiler = os.environ.get("CXX") or os.environ.get("CC")
    compiler = shutil.which(compiler) if compiler else None
    compiler = compiler or next((p for p in map(shutil.which, ("g++", "c++", "clang++", "gcc", "cc", "clang")) if p),
                                None)
    triton = _dist_version("triton")
    status = f"C compiler: {compiler or 'none'}; triton: {triton or 'not installed'}"
    if compiler is None:
        return ("--compile prerequisites", status, "install a C/C++ compiler (e.g. apt install g++) for torch.compile")
    return ("--compile prerequisites", status,
            "" if triton or not shutil.which("nvidia-smi") else "for --compile on CUDA install triton (CUDA torch "
            "wheels bring it)")


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


def rows() -> list[tuple[str, str, str]]:
    """(component, status, fix) for everything the harness can use; fix is "" when nothing is to be done."""
    from harness.backends import flux

    out: list[tuple[str, str, str]] = [
        ("Python", f"{platform.python_version()} ({sys.executable})", ""),
        ("numpy", _dist_version("numpy") or "missing", "" if _dist_version("numpy") else "pip install numpy"),
        _torch_row(),
        _jax_row(),
    ]
    st = flux.julia_status(probe_network=True)
    out.append(("juliacall", st["juliacall"] or "missing",
                "" if st["juliacall"] else "pip install juliacall (needed only for the flux backend)"))
    if st["julia_exe"]:
        jl = f"{st['julia_version'] or '?'} at {st['julia_exe']} (from {st['julia_source']})"
        fix = "" if st["julia_version"] else "this file is not a working Julia: " + flux.SETUP_HINT
    elif st["julia_source"]:
        jl, fix = f"not found: {st['julia_source']}", "point the variable at a Julia 1.10+ executable or unset it"
    else:
        can_download = st["network"] is True
        jl = "not found" + (" (juliapkg will download one)" if can_download else "")
        fix = "run `harness setup julia`" if can_download else flux.SETUP_HINT
    out.append(("Julia executable", jl, fix))
    env = f"{st['project']} ({st['project_from']})"
    if st["resolved"]:
        out.append(("Julia environment", f"installed: {env}", ""))
    else:
        no_net = st["network"] is False and not st["offline"]
        out.append(("Julia environment", f"not installed: {env}",
                    "run `harness setup julia`" + (" on a machine with internet" if no_net else "")))
    out.append((f"{flux.PACKAGE} (Julia)", st["package_path"] or "missing from this installation",
                "" if st["package_path"] else "reinstall nanogpt-parity"))
    if st["installed"]:
        for name in JULIA_PACKAGES:
            version = st["installed"].get(name)
            out.append((f"  {name}.jl", version or "not installed", "" if version else "run `harness setup julia`"))
    else:
        out.append(("  Julia packages", f"not installed ({', '.join(JULIA_PACKAGES[:6])}, ...)",
                    "run `harness setup julia`" if st["juliacall"] else ""))
    out.append(_gpu_row())
    out.append(_cupy_row())
    out.append(_compile_row())
    reason = flux.unavailable_reason("cpu")
    out.append(("flux backend (cpu)", "ready" if reason is None else "unavailable", reason or ""))
    return out


def _print_table(table: list[tuple[str, str, str]]) -> None:
    header = ("component", "status", "fix")
    w0 = max(len(r[0]) for r in [header, *table])
    w1 = min(60, max(len(r[1]) for r in [header, *table]))
    print(f"{header[0]:<{w0}}  {header[1]:<{w1}}  {header[2]}")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 3}")
    for name, status, fix in table:
        print(f"{name:<{w0}}  {status:<{w1}}  {fix}")


def doctor() -> int:
    """Print what is installed and how to fix what is missing; always 0 (it is a report, not a check)."""
    _print_table(rows())
    return 0
