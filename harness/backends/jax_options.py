"""The jax backend's declaration, install hints and `harness doctor` row, importable without JAX.

harness.backends.jax_backend imports no JAX either (it starts JAX in `setup`, in its worker); these live apart so
that its training code and what the parent reads about it change independently.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from harness.backends.declaration import Declaration
from harness.config.fields import OPTION_NAMES
from harness.environment import gpu_seen

INSTALL = "pip install -e '.[jax]' (or pip install jax)"
CUDA_INSTALL = "pip install 'jax[cuda12]' (or 'jax[cuda13]')"  # the declaration's cuda_install
DECLARATION = Declaration(
    name="jax", dtypes=("float32", "float64"), devices=("cpu", "cuda"), options=frozenset({*OPTION_NAMES, "parity"}),
    methods=frozenset({"gradients", "taps", "warm_up", "parts"}), needs="JAX (the jax extra)", install=INSTALL,
    cuda_install=CUDA_INSTALL, color="#2b8a3e", own_process=True, bare_loop="harness.backends.jax_bare:BareJax",
    part_runner="harness.backends.jax_parts:JaxParts",
    doctor="harness.backends.jax_options:doctor_rows")

# run in a child interpreter: doctor's own process never starts JAX (nor, on a GPU, a CUDA context of JAX's)
# the modules of JAX's CUDA plugin (jax-cuda12/13-plugin and -pjrt); any one of them means it is installed
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (a hidden or broken package counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


JAX_PROBE = ("import jax, jaxlib; print(jax.__version__, jaxlib.__version__); "
             "print('; '.join(f'{d.platform} {d.id}' + ('' if d.device_kind == d.platform else f' ({d.device_kind})') "
             "for d in jax.devices()))")


def jax_row() -> tuple[str, str, str]:
    """JAX (the jax backend): its version and the devices it sees, asked of a child interpreter; on a machine with
    an NVIDIA GPU, whether JAX sees it (its CUDA plugin)."""
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
    gpu_missing = gpu_seen() and "gpu" not in devices
    return ("jax", status, f"a GPU is present but JAX does not see it: for --device cuda {CUDA_INSTALL}"
            if gpu_missing else "")


def doctor_rows() -> list[tuple[str, str, str]]:
    """The jax backend's row of `harness doctor`."""
    return [jax_row()]
