"""Where a cell's worker runs: one small seam, two executors.

An executor gets cells whose run directory (spec.json) exists and runs `python -m harness.worker RUN_DIR BACKEND
[--resume]` for each: the ordinary worker, writing the ordinary RunRecord. It never aggregates anything; the
caller reads the records.

- `LocalExecutor`: on this machine. `jobs=1` (the default) runs cells one after another through
  `harness.launch.execute`, so timings never contend; `jobs=N` runs N workers at once (loss-only studies: the
  manifest marks those cells' timings as contended).
- `SlurmExecutor` (harness/sweep/slurm.py): one SLURM job per cell through submitit.

The list may also hold paired-timing entries (`kind` "paired", harness.sweep.manifest): their command is
`python -m harness.paired run <record>` (`paired_command`), which starts every contender on the machine it runs
on (one node), alive at once, and times them in alternating bursts. Locally they run one at a time, never beside a
training cell: with `jobs=N` after the pool of cells.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from harness import launch, records

Notify = Callable[[dict, str], None]  # (cell, event) -> None: "started", "finished"


class Executor(Protocol):
    """Runs the worker of each cell; calls `notify` when a cell starts and when it ends."""

    kind: str

    def run(self, out: Path, cells: list[dict], notify: Notify) -> int:
        """Run `cells` (each with a run_id whose spec exists); returns 0, or 130 when interrupted."""
        ...


def paired_command(out: Path, entry: dict) -> list[str]:
    """The command of a paired-timing entry: a coordinator that adds one session to its record."""
    return [sys.executable, "-m", "harness.paired", "run", str(Path(out) / entry["path"])]


def run_paired_entry(out: Path, entry: dict, progress: bool) -> int:
    """A paired-timing entry in this process (its record exists: harness.sweep.manifest.ensure_paired_doc)."""
    from harness import paired

    try:
        doc = paired.run(Path(out) / entry["path"], progress=progress)
    except KeyboardInterrupt:
        return 130
    last = doc["sessions"][-1] if doc.get("sessions") else {}
    return 1 if last.get("status") == "failed" else 0


def worker_command(run_dir: Path, backend: str, resume: bool) -> list[str]:
    """The ordinary worker's command line (no progress bar: cells run unattended or side by side).

    Sweeps always pass --resume: the worker then continues from the cell's checkpoint when there is one and starts
    from step 0 when there is no record yet, so a cell is never trained twice from the start.
    """
    return [sys.executable, "-m", "harness.worker", str(run_dir), backend, *(["--resume"] if resume else []),
            "--no-progress"]


class LocalExecutor:
    """Cells on this machine: one at a time (timings never contend) or `jobs` at once (timings contended)."""

    kind = "local"

    def __init__(self, jobs: int = 1, progress: bool = True):
        self.jobs, self.progress = jobs, progress

    def run(self, out: Path, cells: list[dict], notify: Notify) -> int:
        if self.jobs <= 1:
            return self._serial(out, cells, notify)
        return self._parallel(out, cells, notify)

    def _serial(self, out: Path, cells: list[dict], notify: Notify) -> int:
        for cell in cells:
            notify(cell, "started")
            if cell.get("kind") == "paired":
                code = run_paired_entry(out, cell, self.progress)
                notify(cell, "finished")
                if code == 130:
                    return 130
                continue
            directory = records.run_dir(out, cell["run_id"])
            codes = launch.execute(directory, [cell["backend"]], resume=True,
                                   progress=self.progress, threads=cell.get("threads"))
            notify(cell, "finished")
            if codes.get(cell["backend"]) == 130:
                return 130
        return 0

    def _parallel(self, out: Path, cells: list[dict], notify: Notify) -> int:
        lock = threading.Lock()
        stop = threading.Event()
        procs: set[subprocess.Popen] = set()

        def one(cell: dict) -> int:
            if stop.is_set():
                return 130
            with lock:
                notify(cell, "started")
            cmd = worker_command(records.run_dir(out, cell["run_id"]), cell["backend"], True)
            env = dict(os.environ, PYTHONUNBUFFERED="1", **launch.thread_env(cell.get("threads")))
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            with lock:
                procs.add(proc)
            code = proc.wait()
            with lock:
                procs.discard(proc)
                notify(cell, "finished")
            return code

        entries = [c for c in cells if c.get("kind") == "paired"]  # after the pool, one at a time
        cells = [c for c in cells if c.get("kind") != "paired"]
        pool = ThreadPoolExecutor(max_workers=self.jobs)
        futures = [pool.submit(one, cell) for cell in cells]
        try:
            codes = [f.result() for f in futures]
        except KeyboardInterrupt:
            stop.set()
            with lock:
                for proc in procs:  # each worker saves its record as interrupted and exits
                    proc.send_signal(signal.SIGINT)
            pool.shutdown(wait=True, cancel_futures=True)
            return 130
        pool.shutdown()
        if 130 in codes:
            return 130
        return self._serial(out, entries, notify)
