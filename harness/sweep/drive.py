"""Running a sweep: create it (every cell validated first, nothing left behind when it cannot start), run its cells
and paired timings through an executor while the manifest follows every event, resume what is missing, and say
how it ended. `harness sweep`, `harness resume SWEEP_ID` and `harness report SWEEP_ID` (harness.cli) call these.

The sweep's HTML report is written by `write_report(out, sweep_id) -> Path`, handed in by the command line: the
reports sit above the sweeps (they read sweep manifests).
"""

from __future__ import annotations

import contextlib
import errno
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.run import plan as run_plan
from harness.store import RunPaths, SweepPaths, check_writable
from harness.store.paths import corpus_copy
from harness.store.spec import DataInfo
from harness.store.sweep import RERUNNABLE, ExecutorSettings, PairedEntry, SweepCell, SweepManifest, SweepSettings
from harness.sweep import manifest as mf
from harness.sweep.plans import cell_doc, check_paired_memory, check_plans, has_run, plan_of, validate
from harness.sweep.spec import SweepSpec, check_count, expand
from harness.sweep.state import SQUEUE_SILENT, counts, local_alive, own, refresh
from harness.units import utc_now

ReportWriter = Callable[[Path, str], Path]  # (out, sweep id) -> the report page written
Result = Callable[[dict], None]  # what a sweep ended with (`finish`'s summary), for the command line to print


def resume_line(m: mf.Manifest) -> str:
    """The command that continues sweep `m`."""
    return f"harness resume {m.sweep_id} --out {shlex.quote(str(m.out))}"


def executor_of(m: mf.Manifest, progress: bool, wait: bool = True) -> Any:
    """The executor the sweep's manifest names: local (this machine) or SLURM (a job array)."""
    ex = m.doc.executor
    if ex.kind == "slurm":
        from harness.sweep.slurm import SlurmExecutor

        return SlurmExecutor.from_settings(m.paths.slurm, ex.slurm, wait=wait, job_name=f"harness-{m.doc.spec.name}")
    from harness.sweep.executors import LocalExecutor

    return LocalExecutor(jobs=ex.jobs, progress=progress)


class Events:
    """What the executor says of each cell and paired entry (started, queued, running, finished): their state and
    attempts set in the manifest, a line on stderr; `notify` saves the manifest once per call."""

    def __init__(self, m: mf.Manifest, total: int):
        self.m, self.total = m, total
        self.done = self.started = 0
        self.start = time.monotonic()
        self.begun: set[int] = set()  # cells an executor started or submitted
        self.contended = m.doc.executor.contended

    def notify(self, items: SweepCell | PairedEntry | list[SweepCell | PairedEntry], event: str) -> None:
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, PairedEntry):
                self.entry(item, event)
            else:
                self.cell(item, event)
        self.m.save()  # once per call: a submitted array of 1000 cells is one write of the manifest, not 1000

    def cell(self, cell: SweepCell, event: str) -> None:
        if event in ("started", "queued"):
            cell.attempts += 1
            cell.status = "running" if event == "started" else "queued"
            self.begun.add(cell.index)
            if event == "started":
                cell.contended = cell.contended or self.contended
                self.started += 1
                print(f"[{self.started}/{self.total}] {cell.key}: run {cell.run_id}", file=sys.stderr, flush=True)
        elif event == "running":
            cell.status = "running"
            print(f"  running {cell.key} (job {cell.job})", file=sys.stderr, flush=True)
        elif event == "finished":
            state, rec = mf.record_status(self.m.out, cell)
            cell.status = "interrupted" if state == "running" else state  # a record left 'running' was killed
            self.done += 1
            info = mf.cell_summary(rec)
            print(f"  {cell.key}: {cell.status} {info['steps']} val {info['val_loss']} "
                  f"({self.pace()})", file=sys.stderr, flush=True)

    def pace(self) -> str:
        """"3/10 done, 1:23 elapsed, about 3:14 left": the cells done, and the rest at the pace so far."""
        from harness.progress import left_s
        from harness.units import fmt_duration

        elapsed = time.monotonic() - self.start
        left = left_s(elapsed, self.done, self.total) if self.done < self.total else None
        return (f"{self.done}/{self.total} done, {fmt_duration(elapsed)} elapsed"
                + (f", about {fmt_duration(left)} left" if left is not None else ""))

    def entry(self, entry: PairedEntry, event: str) -> None:
        if event in ("started", "queued"):
            entry.attempts += 1
            entry.status = "running" if event == "started" else "queued"
            where = f" as SLURM job {entry.job}" if event == "queued" else ""
            print(f"  paired timing {entry.key}{where}", file=sys.stderr, flush=True)
        elif event == "running":
            entry.status = "running"
        elif event == "finished":
            from harness.timing import paired

            state, doc = mf.paired_status(self.m.out, entry)
            entry.status = "interrupted" if state == "running" else state  # a record left 'running' was killed
            line = paired.headline(doc) if doc else "no record"
            print(f"  {entry.key}: {entry.status}; {line}", file=sys.stderr, flush=True)


def run_cells(m: mf.Manifest, todo: list[SweepCell], corpus: object, progress: bool, wait: bool,
              paired: list[PairedEntry] | None = None) -> int:
    """Give every cell of `todo` a run directory (spec.json) and run them, each block's paired timing (`paired`)
    after its last cell; the manifest follows every event.

    Should anything fail before a cell was started or submitted (a full disk while the specs are written, sbatch
    refusing the array), the run directories made here for those cells are removed again, so no run directory
    exists that the manifest does not list."""
    events = Events(m, len(todo))
    fresh: list[SweepCell] = []  # cells given a run directory here
    executor = executor_of(m, progress, wait)
    try:
        for cell in todo:
            if not has_run(m, cell):
                cell.run_id = None
                fresh.append(cell)
                cell.run_id = run_plan.write_spec(plan_of(m, cell, corpus, progress)).run_id
        for entry in paired or []:
            mf.ensure_paired_doc(m.out, entry, m.cells, m.doc.spec.threads)
        m.save()
        return executor.run(m.out, mf.ordered(todo, paired or []), events.notify)
    except BaseException as exc:
        unborn = [c for c in fresh if c.index not in events.begun]
        for cell in unborn:
            if cell.run_id:
                shutil.rmtree(m.run(cell).dir, ignore_errors=True)
            cell.run_id = None
        if unborn:
            with contextlib.suppress(OSError):
                m.save()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) \
                and getattr(executor, "worker_error", False):
            raise DiskFull(m) from None  # a worker has already said so: one error line, not two
        raise


class DiskFull(Exception):
    """The disk filled up during a sweep, and a worker has already printed the error line that says so."""

    def __init__(self, m: mf.Manifest):
        again = resume_line(m)
        super().__init__(f"  sweep {m.sweep_id} stopped: the disk is full (as the worker said above); free some "
                         f"space, then continue with `{again}`")



def finish(m: mf.Manifest, code: int, write_report: ReportWriter | None, result: Result | None = None) -> int:
    """Save the cells' states, print how the sweep stands, write its report; returns the exit status (0 every cell
    completed, or cells still queued or running on SLURM; 1 some did not; 130 interrupted) and hands `result` the
    summary (id, manifest, the cells' and paired timings' states, report, exit status) unless interrupted."""
    rows, prows, answered = refresh(m)
    cells, paired = counts(rows), counts(prows)
    m.save()
    print(f"sweep {m.sweep_id}: " + ", ".join(f"{v} {k}" for k, v in sorted(cells.items())), file=sys.stderr)
    if paired:
        print("paired timing: " + ", ".join(f"{v} {k}" for k, v in sorted(paired.items())), file=sys.stderr)
    if not answered:
        print(SQUEUE_SILENT, file=sys.stderr)
    path = None
    if write_report is not None and cells.get("completed"):
        path = write_report(m.out, m.sweep_id)
        print(f"report: {path}", file=sys.stderr)
    again = f"`{resume_line(m)}`"
    if code == 130:
        print(f"interrupted; continue with {again}", file=sys.stderr)
        return 130
    if cells.get("queued") or cells.get("running"):
        print(f"follow with `harness status {m.sweep_id} --out {shlex.quote(str(m.out))}`", file=sys.stderr)
        status = 0
    else:
        rerun = [f"{cells[k]} {k}" for k in RERUNNABLE if cells.get(k)]
        if rerun:  # e.g. a cell whose job was cancelled: say how to go on (it continues from its checkpoint)
            print(f"{', '.join(rerun)}: run them again (each from its last checkpoint) with {again}",
                  file=sys.stderr)
        status = 0 if cells.get("completed", 0) == len(m.cells) else 1
    if result is not None:
        result({"id": m.sweep_id, "dir": str(m.dir), "manifest": str(m.path), "cells": cells,
                "paired_timings": paired, "report": str(path) if path else None, "exit_status": status})
    return status


def start(spec: SweepSpec, executor: dict, out: Path, data: str | None, *, yes: bool = False, progress: bool = True,
          wait: bool = True, write_report: ReportWriter | None = None, result: Result | None = None) -> int:
    """A new sweep: count, expand and validate its cells (on SLURM also `sbatch --test-only`), write its manifest,
    run everything; returns the exit status of `finish` (2: the disk filled up), which hands `result` its summary.
    A sweep refused or stopped before any cell ran or was submitted leaves nothing behind."""
    check_count(spec, yes)  # by arithmetic: nothing is built for a sweep that is refused for its size
    cells = expand(spec)
    ex = ExecutorSettings.from_dict(executor)  # checked by harness.sweep.settings.check_executor
    slurm = None
    if ex.kind == "slurm":
        from harness.sweep.slurm import SlurmExecutor, check_cluster

        check_cluster(ex.slurm.partition)
        slurm = SlurmExecutor.from_settings(SweepPaths(Path(out).resolve(), "ID").slurm, ex.slurm,
                                            job_name=f"harness-{spec.name}")
    cell_docs = [cell_doc(c, spec) for c in cells]
    entries = mf.paired_entries("ID", cell_docs, spec.paired_rounds)  # their paths name the sweep once it has an id
    corpus = validate(spec, cells, out, data, entries, jobs=ex.jobs if ex.kind == "local" else 1)
    if slurm is not None:  # sbatch --test-only: what sbatch would refuse, refused now
        slurm.check_submission(len(cells), (len(entries), max((len(e.members) for e in entries), default=0)))
    groups = len({c.group for c in cells})
    where = ("one at a time on this machine" if ex.kind == "local" and ex.jobs == 1 else
             f"{ex.jobs} at a time on this machine (timings contended)" if ex.kind == "local"
             else "as a SLURM job array")
    print(f"sweep: {len(cells)} cells ({groups} groups x {len(spec.seeds)} seeds), {where}", file=sys.stderr)
    if len({c.device for c in cells}) > 1 and spec.backend_devices:
        pinned = ", ".join(f"{b} on {d}" for b, d in spec.backend_devices.items())
        print(f"sweep: note: {pinned}: cells on different devices are never timed side by side (no speed verdict "
              "between them)", file=sys.stderr)
    before = _existing(out, corpus)
    paths = SweepPaths.new(Path(out), spec.name)
    for entry in entries:
        entry.path = mf.paired_path(paths.sweep_id, entry.index)
    m = mf.Manifest(paths, SweepManifest(
        sweep_id=paths.sweep_id, created_at=utc_now(), spec=SweepSettings.from_dict(spec.to_dict()),
        executor=ex,
        data=DataInfo(path=corpus.path, sha256=corpus.sha256),  # type: ignore[attr-defined]
        cells=cell_docs, paired=entries))
    own(m)
    try:
        m.save()
        print(f"sweep {paths.sweep_id}: manifest {m.path}", file=sys.stderr)
        if m.paired:
            print(f"sweep: {len(m.paired)} paired timings (each block's backends side by side after its "
                  f"cells, {spec.paired_rounds} undisturbed rounds)", file=sys.stderr)
        code = run_cells(m, m.cells, corpus, progress=progress, wait=wait, paired=m.paired)
    except DiskFull as exc:
        print(exc, file=sys.stderr)
        return 2
    except (UsageError, OSError):
        if not any(c.attempts for c in m.cells):  # nothing ran or was submitted: leave nothing behind
            _discard(m, before)
        raise
    return finish(m, code, write_report, result)


def _existing(out: Path, corpus: object) -> set[Path]:
    """The paths a new sweep may create (its --out, runs/, sweeps/, data/, the corpus copy) that exist already."""
    out = Path(out)
    paths = [out, RunPaths.root(out), SweepPaths.root(out), out / "data",
             corpus_copy(out, corpus.sha256)]  # type: ignore[attr-defined]
    return {p for p in paths if p.exists()}


def _discard(m: mf.Manifest, before: set[Path]) -> None:
    """Remove a new sweep that never started a cell: its run directories, its manifest and what it created."""
    for cell in m.cells:
        if cell.run_id:
            shutil.rmtree(m.run(cell).dir, ignore_errors=True)
    shutil.rmtree(m.dir, ignore_errors=True)
    out = Path(m.out)
    copy = corpus_copy(out, m.doc.data.sha256)
    if copy not in before:
        with contextlib.suppress(OSError):
            copy.unlink()
    for path in (RunPaths.root(out), SweepPaths.root(out), out / "data", out):
        if path not in before:
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty


def resume(out: Path, sweep_id: str, *, jobs: int | None = None, progress: bool = True, wait: bool = True,
           write_report: ReportWriter | None = None, result: Result | None = None) -> int:
    """Run the cells of a sweep that are pending, failed or interrupted (never one that completed or still runs);
    `jobs`: the local executor's cells at once, instead of the stored value.

    Every cell to run is checked again (config, backend, device, options, memory, and on SLURM `sbatch --test-only`)
    before a run directory is made for it or anything is submitted."""
    from harness.core.data import load_corpus

    m = mf.Manifest.load(out, sweep_id)  # schema, executor settings and cell configs checked
    ex = m.doc.executor
    if jobs and ex.kind == "local":
        ex.jobs = jobs
    elif jobs:
        raise UsageError(f"--jobs is for the local executor and sweep {m.sweep_id} runs on SLURM; drop --jobs")
    if local_alive(m):
        raise UsageError(f"sweep {m.sweep_id} is still running (or waiting for its jobs) in process "
                         f"{m.doc.owner.pid if m.doc.owner else '?'}; wait for it or stop it first")
    if ex.kind == "slurm":
        from harness.sweep.slurm import check_cluster

        check_cluster(ex.slurm.partition)
    corpus = load_corpus(m.doc.data.path)
    if corpus.sha256 != m.doc.data.sha256:
        raise UsageError(f"data file {corpus.path!r} changed since the sweep started; restore it")
    if not refresh(m).squeue_answered:  # which jobs still run is unknown: submitting now could run a cell twice
        raise UsageError(f"squeue did not answer, so whether the jobs of sweep {m.sweep_id} still run is unknown and "
                         "nothing is submitted again; retry `harness resume` once squeue answers")
    todo = [c for c in m.cells if c.status in RERUNNABLE]
    ptodo = [e for e in m.paired if e.status in mf.PAIRED_RERUNNABLE]
    check_plans([plan_of(m, c, corpus) for c in todo], ex.jobs if ex.kind == "local" else 1)
    check_paired_memory({i: plan_of(m, m.cells[i], corpus) for e in ptodo for i in e.members}, ptodo)
    if (todo or ptodo) and ex.kind == "slurm":
        executor_of(m, progress=False).check_submission(
            len(todo), (len(ptodo), max((len(e.members) for e in ptodo), default=0)))
    busy = sum(c.status in ("queued", "running") for c in m.cells)
    print(f"sweep {m.sweep_id}: {len(todo)} of {len(m.cells)} cells to run"
          + (f", {len(ptodo)} paired timings" if ptodo else "")
          + (f", {busy} still queued or running (left alone)" if busy else ""), file=sys.stderr)
    own(m)
    m.save()
    try:
        code = run_cells(m, todo, corpus, progress=progress, wait=wait, paired=ptodo) if todo or ptodo else 0
    except DiskFull as exc:
        print(exc, file=sys.stderr)
        return 2
    return finish(m, code, write_report, result)


def report(out: Path, sweep_id: str, write_report: ReportWriter) -> Path:
    """Rebuild the report of sweep `sweep_id` from its records (its cells' states refreshed first)."""
    m = mf.Manifest.load(out, sweep_id)
    check_writable(out)
    refresh(m)
    return write_report(m.out, m.sweep_id)
