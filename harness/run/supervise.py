"""The parent side of `harness run`: validate everything, write the spec, run one worker per backend, compare.

Nothing is written until every input has been checked (including a memory estimate from the shapes), so bad
input leaves no files behind.

Executors: `run_backend(paths, backend, ...)` is the seam, a plain function that trains one backend of a run
(its `RunPaths`) in the calling process (no signal or argv handling; it takes the run-directory lock itself). The local
executor, `run_worker`, runs it in a fresh interpreter (`python -m harness --worker train`) and supervises it:

- the worker gets PR_SET_PDEATHSIG at spawn (before its first instruction), so it stops if `harness` dies;
- Ctrl-C / SIGTERM are forwarded once (with SIGCONT, so a stopped worker wakes up to save its record); a worker
  that has not exited `KILL_GRACE_S` seconds later is killed with SIGKILL;
- a worker that dies by a signal (SIGKILL, the OOM killer, a segfault) has its record marked with the signal's
  name instead of staying "running"; a completed record is never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from harness.errors import UsageError
from harness.run.processes import KILL_GRACE_S, spawn
from harness.store import LOCK_FD_ENV, RunLock, RunPaths, RunRecord, RunSpec, Status
from harness.store.paired import Contender, PairedRecord
from harness.units import utc_now


# --- the executor seam ------------------------------------------------------------------------------------------
def run_backend(paths: RunPaths, backend: str, resume: bool = False, progress: bool = True) -> int:
    """Train one backend of run `paths` in this process; returns the worker's exit status (0/1/2/130).

    No signal or argv handling: an executor (a subprocess, a SLURM job) arranges how it is stopped. The
    run-directory lock is taken here (exit status 2 when another process holds it).
    """
    from harness.run.worker import run_backend as _run

    return _run(paths, backend, resume=resume, progress=progress)


def spawn_worker(paths: RunPaths, backend: str, resume: bool = False, progress: bool = True,
                 threads: int | None = None, lock: RunLock | None = None, spec: RunSpec | None = None
                 ) -> subprocess.Popen:
    """Start one backend's worker (`python -m harness --worker train`, harness.run.processes.spawn), whoever starts
    it (`run_worker`, the sweep's parallel local executor), with the compile caches under --out where it compiles and
    the run-directory lock `lock` shared with it. `spec`: the run's spec, where the caller has read it.

    PR_SET_PDEATHSIG fires when the *thread* that forked the worker ends: call this from a thread that outlives the
    worker (the main thread)."""
    args = [str(paths.dir), backend, *(["--resume"] if resume else []), *([] if progress else ["--no-progress"])]
    try:
        compiles = bool((spec or RunSpec.load(paths)).options_of(backend).get("compile"))
    except UsageError:
        compiles = False  # the worker reports a bad spec itself
    env: dict[str, str] = {}
    pass_fds: tuple[int, ...] = ()
    if lock is not None and lock.fd is not None:
        env[LOCK_FD_ENV] = str(lock.fd)
        pass_fds = (lock.fd,)
    return spawn("train", args, threads, compiles, env=env, pass_fds=pass_fds)


def run_worker(paths: RunPaths, backend: str, resume: bool = False, progress: bool = True,
               threads: int | None = None, lock: RunLock | None = None, spec: RunSpec | None = None) -> int:
    """Run one backend's worker process to its end and return its exit status (128+N when killed by signal N).

    Ctrl-C / SIGTERM here are forwarded once (with SIGCONT); after `KILL_GRACE_S` the worker is SIGKILLed. A
    worker that died by a signal has its record marked (see `mark_ended`). `lock`: the run-directory lock the
    caller holds; the worker shares it (without one, the worker takes the lock itself).
    """
    proc = spawn_worker(paths, backend, resume=resume, progress=progress, threads=threads, lock=lock, spec=spec)
    asked: list[str] = []  # the signals we received (forwarded once)

    def forward(signum: int, frame: object) -> None:
        if not asked:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
                proc.send_signal(signal.SIGCONT)  # a stopped worker must wake up to handle it
        asked.append(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    killed = False
    try:
        deadline = None
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if asked and deadline is None:
                deadline = time.monotonic() + KILL_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                print(f"{backend}: the worker did not stop {KILL_GRACE_S:g} s after {asked[0]}; killing it "
                      "(SIGKILL)", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                deadline = float("inf")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:
        mark_ended(paths, backend, -code, stopped_by=asked[0] if asked else None, killed_by_us=killed, lock=lock)
        return 130 if asked else 128 - code
    # asked to stop, a worker that did not complete was interrupted, whatever its status says (one stopped while its
    # interpreter was still starting exits 1): the caller (a sweep) must not go on to the next cell
    return 130 if asked and code != 0 else code


def mark_ended(paths: RunPaths, backend: str, signum: int, stopped_by: str | None = None,
               killed_by_us: bool = False, lock: RunLock | None = None) -> None:
    """Record that `backend`'s worker died by signal `signum`: a record left "running" becomes "interrupted" (when
    we were asked to stop it) or "failed: killed by SIG..."; a completed record is never touched."""
    name = signal.Signals(signum).name
    why = {"SIGKILL": " (SIGKILL: the out-of-memory killer, or someone's kill -9)"}.get(name, "")
    held = None
    try:
        if lock is None:
            held = RunLock(paths).acquire()
        path = paths.record(backend)
        if not path.exists():
            print(f"{backend}: the worker was killed by {name}{why} before it wrote a record", file=sys.stderr)
            return
        rec = RunRecord.load(path, backend)
        if rec.status is not Status.RUNNING:
            return
        if stopped_by:
            rec.status = Status.INTERRUPTED
            rec.error = (f"stopped by {stopped_by}; the worker did not exit within {KILL_GRACE_S:g} s and was "
                         f"killed with {name}" if killed_by_us else f"stopped by {stopped_by}; the worker died "
                         f"by {name}")
        else:
            rec.fail(f"killed by {name}")
            rec.error = f"the worker process was killed by {name}{why}; everything measured until its last " \
                        "save is kept"
        rec.signal = name
        rec.finished_at = utc_now()
        rec.dump(paths)
        print(f"{backend}: the worker was killed by {name}{why}; its record is marked {rec.status_text!r}",
              file=sys.stderr)
    except (UsageError, OSError) as exc:
        print(f"{backend}: the worker was killed by {name}; its record could not be marked ({exc})",
              file=sys.stderr)
    finally:
        if held is not None:
            held.release()


PAIRED = "paired timing"  # the key of the paired timing's exit status in `execute`'s result


def execute(paths: RunPaths, backends: list[str], resume: bool = False, progress: bool = True,
            threads: int | None = None, paired_rounds: int = 0, chained: bool = False) -> dict[str, int]:
    """Run the workers one after another (never at once: they would share cores and skew each other's times),
    then, with `paired_rounds` and two or more completed backends, their paired timing (harness.run.paired_timing: every
    backend alive at once, timed in alternating bursts), into `<run>/paired.json`; an existing record there gets a
    new session only while it lacks undisturbed rounds.

    The run directory is locked for the whole time (UsageError when another process holds it); a `resume` checks
    the spec, every record and checkpoint first (harness.run.resumable: UsageError, nothing written). Returns each
    backend's exit status, and under `PAIRED` 130 when the paired timing was interrupted. `chained` (parity: each
    backend reads what the one before wrote): a backend that does not complete ends the run there.
    """
    codes: dict[str, int] = {}
    try:
        spec: RunSpec | None = RunSpec.load(paths)  # read once here, for every worker and the paired timing
    except UsageError:
        if resume:
            raise
        spec = None  # each worker reports a bad spec itself
    with RunLock(paths) as lock:
        if resume and spec is not None:  # every backend's files checked before any worker starts or writes
            from harness.run import resumable

            resumable.check_run(paths, spec, backends)
        for i, name in enumerate(backends, 1):
            path = paths.record(name)
            if resume and path.exists():
                try:
                    if RunRecord.load(path, name).finished:
                        codes[name] = 0
                        continue
                except UsageError:
                    pass
            print(f"[{i}/{len(backends)}] {name}: training in its own process", file=sys.stderr, flush=True)
            codes[name] = code = run_worker(paths, name, resume=resume, progress=progress, threads=threads,
                                            lock=lock, spec=spec)
            if code == 130 or (chained and code != 0):  # interrupted, or the next one needs this one's results
                return codes
        done = [b for b in backends if codes.get(b) == 0]
        if paired_rounds and len(done) >= 2 and spec is not None:
            try:
                run_paired(paths, spec, done, paired_rounds, threads, progress)
            except KeyboardInterrupt:
                print("paired timing interrupted; the rounds measured so far are kept", file=sys.stderr)
                codes[PAIRED] = 130
    return codes


def run_paired(paths: RunPaths, spec: RunSpec, backends: list[str], rounds: int, threads: int | None = None,
               progress: bool = True) -> PairedRecord:
    """The paired timing of `backends` of run `paths` (the caller holds the run-directory lock)."""
    from harness.run import paired_timing

    run_dir = str(paths.dir.resolve())
    contenders = [Contender(name=b, run_dir=run_dir, backend=b, options=spec.options_of(b), device=spec.device_of(b))
                  for b in backends]
    doc = None if paths.paired_timing.exists() else paired_timing.new_doc(contenders, spec.label or "", spec.seed,
                                                                          rounds, threads)
    return paired_timing.run(paths.paired_timing, doc, progress=progress, rounds=rounds)
