"""How the harness starts a child process that trains or times a model: its environment and its tie to us.

One place for what `launch.spawn_worker` (a run's workers, the sweep's parallel executor), the paired timing's
contenders and the SLURM jobs set up the same way: the thread caps, an unbuffered stdout, no inherited run lock,
and, where the backend compiles, the compile caches under --out. Local children also get PR_SET_PDEATHSIG, so that
none outlives its coordinator; a SLURM job's worker does not need it (SLURM ends every process of a job).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from harness.run.records import LOCK_FD_ENV, RunPaths


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment that caps the CPU threads of every framework (torch/OpenMP, OpenBLAS, MKL, Julia)."""
    if not threads:
        return {}
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n, "JULIA_NUM_THREADS": n}


def compile_cache_env(directory: Path) -> dict[str, str]:
    """torch.compile's caches (Inductor, Triton) go into `<out>/cache/` unless the user chose a place."""
    cache = RunPaths.of_dir(directory).out / "cache"
    env = {}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton")):
        if not os.environ.get(var):
            env[var] = str((cache / sub).resolve())
    return env


def child_env(threads: int | None, compile_dir: Path | None = None) -> dict[str, str]:
    """This process's environment for a child: unbuffered, thread caps, no inherited run-lock descriptor, and the
    compile caches of the run at `compile_dir` (given when its backend compiles)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **thread_env(threads))
    env.pop(LOCK_FD_ENV, None)
    if compile_dir is not None:
        env.update(compile_cache_env(compile_dir))
    return env


def pdeathsig() -> None:
    """`preexec_fn` for Popen: in the child, between fork and exec, ask for SIGTERM when the forking thread ends.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: spawn from a thread that outlives it."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
