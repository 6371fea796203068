"""How the harness starts a child process that trains or times a model: its command line, environment and tie to us.

Every child is one program, `python -m harness --worker KIND ARGS...` (harness.run.child: the kinds), and one function
builds its command line (`child_command`), whoever starts it: `spawn` here (a run's workers, the sweep's parallel
executor, the paired timing's timed processes, `harness bench overhead --isolate`) and the SLURM jobs
(harness.sweep.slurm).
Every child gets the same environment (`child_env`: the thread caps, an unbuffered stdout, no inherited run lock
and, where the backend compiles, the compile caches under --out) and, when started locally, the one parent-death
signal (`pdeathsig`, PR_SET_PDEATHSIG at spawn), so that none outlives its coordinator.

No orphans: every process the harness starts, a harness child or any other command (the busy-loop hogs of `harness
bench noise`, a leg's `harness` command), starts through `start` (or `spawn`, which uses it): in its own session,
with the parent-death signal, so that it stops when the harness dies, even by SIGKILL. A command that starts
children ends them, whatever ends it (its end, an error, Ctrl-C, SIGTERM, which the CLI turns into Ctrl-C), by
starting them inside `ending`:

    with processes.ending() as children:
        children.append(processes.start([sys.executable, "-c", "..."]))
        ...  # on leaving the block, each still running gets SIGINT (and SIGCONT), SIGKILL KILL_GRACE_S s later

(`stop` does the same for a list of processes at any moment.) Call `start` from the main thread: the parent-death
signal fires when the *thread* that started the child ends, so a child started from a short-lived thread would be
stopped with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from harness.run.child import KINDS, PARENT_PID_ENV, WORKER_FLAG
from harness.store import LOCK_FD_ENV
from harness.timing import contention

KILL_GRACE_S = float(os.environ.get("HARNESS_KILL_GRACE_S", "10"))  # a stop signal -> SIGKILL, for a wedged child


def child_command(kind: str, *args: str | os.PathLike) -> list[str]:
    """The command line of a child of `kind` (harness.run.child.KINDS): this interpreter running the harness with
    the hidden worker flag."""
    if kind not in KINDS:
        raise ValueError(f"unknown child kind {kind!r}; one of {', '.join(KINDS)}")
    return [sys.executable, "-m", "harness", WORKER_FLAG, kind, *(str(a) for a in args)]


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment that caps the CPU threads of every framework (torch/OpenMP, OpenBLAS, MKL, Julia, and XLA:
    PJRT_NPROC sizes its intra-op pool, which OMP_NUM_THREADS does not reach)."""
    if not threads:
        return {}
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n, "JULIA_NUM_THREADS": n,
            "PJRT_NPROC": n}


def busy_machine_line(threads: int | None, probe: contention.Probe | None = None) -> str | None:
    """One line saying what to do when the machine has fewer idle CPUs than a worker's threads (None when it has
    enough, or cannot say): measured at the start, over a fifth of a second (contention.others_busy). The backends
    train one after another and the paired timing runs one burst at a time, so one worker's threads (`threads`,
    else the framework's default of one per usable CPU) are what must fit. Threads that find no idle CPU make every
    step wait: a run on a busy 2-core machine was 100x slower (245 ms a step against 2.3 ms)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    got = contention.others_busy(probe or contention.Probe())
    if got is None:
        return None
    others, ncpu = got
    idle = max(0.0, min(float(usable), ncpu - others))
    want = threads or usable
    if want - idle < 0.5:
        return None
    fit = max(1, int(idle))
    what = f"each backend would run {want} thread{'s' if want > 1 else ''}" + ("" if threads else " (its default)")
    fix = (f"pass --threads {fit}, or run when the machine is quiet" if fit < want else
           "run when the machine is quiet")
    return (f"warning: the machine is busy: other processes keep about {others:.1f} of its {ncpu} CPUs busy and "
            f"{what}, so the steps will wait for CPUs and the speed figures will be marked disturbed; {fix}")


def compile_cache_env() -> dict[str, str]:
    """torch.compile's caches (Inductor, Triton) go into the user cache directory (harness.environment.cache_dir:
    `<harness cache>/torchinductor` and `/triton`, beside JAX's) unless the user chose a place: never into --out, where
    a linked folder would take them elsewhere, and shared by every run as JAX's cache is."""
    from harness.environment import cache_dir

    env = {}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton")):
        if not os.environ.get(var):
            env[var] = str((cache_dir() / sub).resolve())
    return env


def child_env(threads: int | None, compiles: bool = False) -> dict[str, str]:
    """This process's environment for a child: unbuffered, thread caps, no inherited run-lock descriptor, and the
    compile caches (`compiles`: its backend compiles)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **thread_env(threads))
    env.pop(LOCK_FD_ENV, None)
    if compiles:
        env.update(compile_cache_env())
    return env


def pdeathsig() -> None:
    """`preexec_fn` for Popen: in the child, between fork and exec, ask for SIGTERM when the forking thread ends,
    and let SIGINT be heard.

    The one place the harness asks for the parent-death signal (it survives the exec). PR_SET_PDEATHSIG fires when
    the *thread* that forked the child ends: spawn from a thread that outlives it. SIGINT is how `stop` asks a child
    to write its record and end: a harness started in the background of a script (`harness sweep ... &`) inherits
    SIGINT ignored, and a child that inherited that too would only end by SIGKILL, its last record unwritten."""
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python then installs its KeyboardInterrupt handler at start
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(argv: Sequence[str | os.PathLike], **popen: Any) -> subprocess.Popen:
    """Start any command as a child tied to this process: in its own session (a terminal's Ctrl-C reaches only us;
    `stop` decides what the child gets) and with the parent-death signal (SIGTERM when this process dies, even by
    SIGKILL). `popen`: the rest of Popen's arguments. From the main thread only (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("processes.start: start children from the main thread (the parent-death signal fires "
                           "when the thread that started the child ends)")
    return subprocess.Popen([str(a) for a in argv], start_new_session=True, preexec_fn=pdeathsig, **popen)


def stop(procs: Sequence[subprocess.Popen], sig: int = signal.SIGINT, grace_s: float | None = None) -> None:
    """End every process of `procs` still running, with everything in its process group: `sig` (and SIGCONT, so
    that a stopped one can handle it), then SIGKILL to the group of any still running `grace_s` seconds later
    (default `KILL_GRACE_S`); each is reaped. Further SIGINT/SIGTERM wait until this is done (on the main thread)."""
    grace_s = KILL_GRACE_S if grace_s is None else grace_s
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        running = [p for p in procs if p.poll() is None]
        for proc in running:
            _send(proc, sig)
            _send(proc, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.02)
        for proc in running:
            if proc.poll() is None:
                _send(proc, signal.SIGKILL)
            proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _send(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to `proc`'s process group when it leads one (started by `start`), else to `proc` alone (never to a
    group it shares with us)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


@contextlib.contextmanager
def ending(sig: int = signal.SIGINT, grace_s: float | None = None) -> Iterator[list[subprocess.Popen]]:
    """A list for the children started in the block (`start`), every one still running ended (`stop`) when the
    block ends, however it ends."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        stop(procs, sig, grace_s)


def spawn(kind: str, args: Sequence[str | os.PathLike], threads: int | None = None, compiles: bool = False,
          env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start a child of `kind` with `args`, set up as every local child is: `child_env` (plus `env`), its own session
    (a terminal Ctrl-C reaches only us; we decide what the child gets), PR_SET_PDEATHSIG at spawn (it stops if this
    process dies, even before its first instruction) and this process's pid in HARNESS_PARENT_PID (checked by the
    child, harness.run.child.check_parent). `popen`: the rest of Popen's arguments (pipes, pass_fds)."""
    full = child_env(threads, compiles)
    full[PARENT_PID_ENV] = str(os.getpid())
    full.update(env or {})
    return subprocess.Popen(child_command(kind, *args), env=full, start_new_session=True, preexec_fn=pdeathsig,
                            **popen)  # as `start`, which refuses other threads: a worker may start from one
