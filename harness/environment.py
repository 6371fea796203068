"""What machine and software a run used: captured into every RunRecord."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

import harness


def loadavg() -> tuple[float, float, float] | None:
    """The machine's 1-, 5- and 15-minute load averages; None where the system keeps none."""
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; every core where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def nvidia_smi(fields: str) -> list[str] | None:
    """`nvidia-smi --query-gpu=FIELDS` of the GPU a CUDA process would use (the first of CUDA_VISIBLE_DEVICES): its
    comma-separated values, or None when nvidia-smi is missing or does not answer (10 s at most). The parent process
    asks nvidia-smi, never a framework, so that it holds no CUDA context (harness.backends.numpy_backend
    .cupy_ready_in_child says why that matters)."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"] + ([f"--id={visible}"] if visible else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
        return [v.strip() for v in out.strip().splitlines()[0].split(",")]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def gpu_seen() -> bool:
    """Whether this machine shows an NVIDIA GPU at all: its driver lists one (/proc/driver/nvidia/gpus), its control
    device exists, or nvidia-smi is installed. False says "there is no GPU here" in an error, rather than an install
    hint (harness.backends.base.cuda_fix)."""
    import shutil

    gpus = "/proc/driver/nvidia/gpus"
    return ((os.path.isdir(gpus) and bool(os.listdir(gpus))) or os.path.exists("/dev/nvidiactl")
            or shutil.which("nvidia-smi") is not None)


def gpu_capability() -> tuple[int, int] | None:
    """The compute capability of that GPU, e.g. (9, 0), from nvidia-smi; None when it cannot tell (no nvidia-smi, or
    a driver older than 510, whose nvidia-smi has no compute_cap)."""
    values = nvidia_smi("compute_cap")
    try:
        major, minor = values[0].split(".")
        return int(major), int(minor)
    except (TypeError, ValueError, IndexError):
        return None


def git_commit() -> str | None:
    """The commit of the harness checkout (None outside a git checkout), with '+dirty' for local changes."""
    root = Path(harness.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def capture() -> dict:
    """Python, OS, CPU, cores, memory, harness version and git commit (framework versions come from backends)."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem,
        "numpy": np.__version__,
        "harness_version": harness.__version__,
        "git_commit": git_commit(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
    }


def cache_dir() -> Path:
    """Where the downloaded corpus is kept (override with HARNESS_CACHE)."""
    if os.environ.get("HARNESS_CACHE"):
        return Path(os.environ["HARNESS_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("nanogpt-parity"))
