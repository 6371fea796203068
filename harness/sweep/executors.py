"""Where a cell's worker runs: one small seam, two executors.

An executor gets cells whose run directory (spec.json) exists and runs `python -m harness --worker train RUN_DIR
BACKEND --resume` for each: the ordinary worker, writing the ordinary RunRecord. It never aggregates anything; the
caller reads the records.

- `LocalExecutor`: on this machine. `jobs=1` (the default) runs cells one after another through
  `harness.run.supervise.execute`, so timings never contend; `jobs=N` runs N workers at once (loss-only studies: the
  manifest marks those cells' timings as contended). Either way each worker is started by
  `harness.run.supervise.spawn_worker` from the main thread, so it gets the parent-death signal at spawn: a sweep killed
  at any moment leaves no worker training unsupervised.
- `SlurmExecutor` (harness/sweep/slurm.py): the cells as SLURM job arrays through submitit.

The list may also hold paired-timing entries (harness.store.sweep.PairedEntry): their command is `python -m
harness --worker paired <record>` (`paired_command`), which starts every contender on the machine it runs on (one
node), alive at once, and times them in alternating bursts. Locally they run one at a time, never beside a training
cell: with `jobs=N` after the pool of cells. Both command lines come from harness.run.processes.child_command, the one
builder of every child's command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from harness.errors import UsageError
from harness.run import supervise
from harness.run.processes import child_command
from harness.store import RunPaths
from harness.store.sweep import PairedEntry, SweepCell

Item = SweepCell | PairedEntry  # what an executor runs: a cell's worker, or a paired entry's coordinator
# (item, or several at once, event) -> None; events: "started", "queued", "running", "finished". Several items in one
# call (a submitted job array, the jobs one poll found over) are one write of the manifest, not one each.
Notify = Callable[[Item | list[Item], str], None]


class Executor(Protocol):
    """Runs the worker of each cell; calls `notify` when a cell starts and when it ends."""

    kind: str

    def run(self, out: Path, cells: list[Item], notify: Notify) -> int:
        """Run `cells` (each with a run_id whose spec exists); returns 0, or 130 when interrupted."""
        ...


def cell_run(out: Path, cell: SweepCell) -> RunPaths:
    """The run directory of `cell` (it has a run id)."""
    return RunPaths(Path(out), cell.run_id or "")


def paired_command(out: Path, entry: PairedEntry) -> list[str]:
    """The command of a paired-timing entry: a coordinator that adds one session to its record."""
    return child_command("paired", entry.record(out))


def run_paired_entry(out: Path, entry: PairedEntry, progress: bool) -> int:
    """A paired-timing entry in this process (its record exists: harness.sweep.manifest.ensure_paired_doc)."""
    from harness.run import paired_timing

    try:
        doc = paired_timing.run(entry.record(out), progress=progress)
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:  # a damaged record: this entry fails, the sweep's other cells go on
        print(f"harness: error: paired timing {entry.key}: {exc}", file=sys.stderr)
        return 1
    last = doc.last_session
    return 1 if last is not None and last.status == "failed" else 0


def worker_command(run_dir: Path, backend: str, resume: bool) -> list[str]:
    """The ordinary worker's command line (no progress bar: cells run unattended or side by side).

    Sweeps always pass --resume: the worker then continues from the cell's checkpoint when there is one and starts
    from step 0 when there is no record yet, so a cell is never trained twice from the start.
    """
    return child_command("train", run_dir, backend, *(["--resume"] if resume else []), "--no-progress")


class LocalExecutor:
    """Cells on this machine: one at a time (timings never contend) or `jobs` at once (timings contended)."""

    kind = "local"

    def __init__(self, jobs: int = 1, progress: bool = True):
        self.jobs, self.progress = jobs, progress
        self.worker_error = False  # a worker exited with status 2 (it printed its one error line itself)

    def run(self, out: Path, cells: list[Item], notify: Notify) -> int:
        if self.jobs <= 1:
            return self._serial(out, cells, notify)
        return self._parallel(out, cells, notify)

    def _serial(self, out: Path, cells: list[Item], notify: Notify) -> int:
        for cell in cells:
            if isinstance(cell, PairedEntry):
                notify(cell, "started")
                code = run_paired_entry(out, cell, self.progress)
                notify(cell, "finished")
                if code == 130:
                    return 130
                continue
            notify(cell, "started")
            codes = supervise.execute(cell_run(out, cell), [cell.backend], resume=True, progress=self.progress,
                                      threads=cell.threads)
            self.worker_error = self.worker_error or codes.get(cell.backend) == 2
            notify(cell, "finished")
            if codes.get(cell.backend) == 130:
                return 130
        return 0

    def _parallel(self, out: Path, cells: list[Item], notify: Notify) -> int:
        """Up to `jobs` workers at once, started and watched from this (the main) thread; the paired-timing entries
        after them, one at a time."""
        entries: list[Item] = [c for c in cells if isinstance(c, PairedEntry)]
        queue = [c for c in cells if isinstance(c, SweepCell)]
        running: dict[subprocess.Popen, SweepCell] = {}
        interrupted = False

        def reap(proc: subprocess.Popen, stopped_by: str | None = None, killed: bool = False) -> None:
            nonlocal interrupted
            cell = running.pop(proc)
            code = proc.returncode
            self.worker_error = self.worker_error or code == 2
            if code < 0:  # killed by a signal: its record must not stay "running"
                supervise.mark_ended(cell_run(out, cell), cell.backend, -code, stopped_by=stopped_by,
                                     killed_by_us=killed)
            interrupted = interrupted or code == 130 or stopped_by is not None
            notify(cell, "finished")

        try:
            while queue or running:
                while queue and len(running) < self.jobs:
                    cell = queue.pop(0)
                    notify(cell, "started")
                    proc = supervise.spawn_worker(cell_run(out, cell), cell.backend, resume=True, progress=False,
                                                  threads=cell.threads)
                    running[proc] = cell
                for proc in [p for p in running if p.poll() is not None]:
                    reap(proc)
                time.sleep(0.05)
        except KeyboardInterrupt:
            self._stop(running, reap)
            return 130
        return 130 if interrupted else self._serial(out, entries, notify)

    @staticmethod
    def _stop(running: dict[subprocess.Popen, SweepCell], reap: Callable[..., None]) -> None:
        """Ctrl-C / SIGTERM: each worker gets one SIGINT (it saves its record as interrupted and exits); one that
        has not exited `launch.KILL_GRACE_S` seconds later is killed. Further signals wait until this is done."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for proc in running:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                    proc.send_signal(signal.SIGCONT)  # a stopped worker must wake up to handle it
            deadline = time.monotonic() + supervise.KILL_GRACE_S
            while running and time.monotonic() < deadline:
                for proc in [p for p in running if p.poll() is not None]:
                    reap(proc, stopped_by="SIGINT")
                time.sleep(0.05)
            for proc in list(running):
                print(f"{running[proc].backend}: the worker did not stop {supervise.KILL_GRACE_S:g} s after SIGINT; "
                      "killing it (SIGKILL)", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                reap(proc, stopped_by="SIGINT", killed=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
