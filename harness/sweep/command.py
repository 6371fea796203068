"""`harness sweep`: expand a spec into cells, validate them all, run them through an executor, report.

    harness sweep --sizes small,medium --backends torch,numpy --seeds 3 --steps 300
    harness sweep grid.toml --executor slurm --partition gpu --gpus-per-job 1
    harness sweep --status SWEEP_ID
    harness sweep --resume SWEEP_ID
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness import launch, records
from harness.errors import UsageError
from harness.options import listed, pick_backends, pick_sizes
from harness.sweep import manifest as mf
from harness.sweep.spec import MAX_CELLS_WITHOUT_YES, Cell, SweepSpec, build_spec, expand, load_toml, parse_set


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness sweep`."""
    from harness.config import PRESETS, SIZES
    from harness.options import (
        DEFAULT_OUT,
        THREADS_HELP,
        add_backend,
        add_data,
        add_paired,
        add_quiet,
        add_size,
        out_arg,
        positive_int,
        seed_arg,
    )

    p.add_argument("spec", nargs="?", metavar="SPEC.toml", help="a sweep file (flags override its keys)")
    g = p.add_argument_group("axes (cells are the cross product)")
    add_size(g, f"size preset(s): {', '.join(PRESETS)}, or all ({', '.join(SIZES)}); repeat or comma-separate "
             "(default small)")
    g.add_argument("--config", "--configs", dest="config", action="append", metavar="FILE[,FILE...]",
                   help="TOML config files as axis values (beside or instead of --size); repeat or comma-separate")
    add_backend(g, "torch, numpy, flux, or all (every backend that can run here); repeat or comma-separate "
                "(default torch)")
    g.add_argument("--seed", action="append", type=seed_arg, metavar="S",
                   help="a seed of the seed axis (repeatable); or use --seeds")
    g.add_argument("--seeds", metavar="N|S1,S2", help="a count (N seeds from 1337) or a list (default 1)")
    g.add_argument("--device", type=_csv, metavar="D[,D]", help="cpu and/or cuda, comma-separated (default cpu)")
    g.add_argument("--precision", type=_csv, metavar="P[,P]", help="torch/flux matmul precision: fp32, tf32, bf16")
    g.add_argument("--dtype", type=_csv, metavar="T[,T]", help="float32 and/or float64 where the backend has a choice")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                   help="any config field as a list, e.g. --set learning_rate=0.003,0.01 (repeatable); "
                   "d_hidden follows n_embd unless set too")
    g = p.add_argument_group("schedule (every cell)")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--steps", type=positive_int, metavar="N", help="train every cell exactly N steps")
    s.add_argument("--epochs", type=positive_int, metavar="N", help="train every cell N epochs (preset: 20)")
    g.add_argument("--eval-interval", type=positive_int, metavar="N", help="evaluate every N steps")
    g.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help="checkpoint every N steps, so an interrupted or requeued cell resumes there")
    g.add_argument("--threads", type=positive_int, metavar="N", help=f"{THREADS_HELP}, in every cell; default: "
                   "the frameworks' own choice")
    g.add_argument("--no-text", action="store_true", help="skip generation, BLEU and chrF in every cell")
    add_paired(g, None)
    g.add_argument("--name", metavar="NAME", help="a name for the sweep (part of its id)")
    g = p.add_argument_group("executor")
    g.add_argument("--executor", choices=("local", "slurm"), help="local (default): this machine; slurm: submitit")
    g.add_argument("--jobs", type=positive_int, metavar="N", help="local: N cells at once (timings then contend)")
    g.add_argument("--partition", metavar="P", help="slurm partition")
    g.add_argument("--gpus-per-job", type=positive_int, metavar="N", help="slurm: GPUs per job (sbatch "
                   "--gpus-per-node)")
    g.add_argument("--cpus-per-job", type=positive_int, metavar="N", help="slurm: CPUs per job (sbatch "
                   "--cpus-per-task)")
    g.add_argument("--mem-gb", type=float, metavar="G", help="slurm: memory per job in GB (sbatch --mem); without "
                   "it the cluster's default applies, which on some clusters is a whole node")
    g.add_argument("--time-min", type=positive_int, metavar="M", help="slurm time limit per job (60)")
    g.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE", help="extra sbatch option")
    g.add_argument("--no-wait", action="store_true", help="slurm: submit and return; follow with --status")
    g = p.add_argument_group("other")
    g.add_argument("--status", metavar="SWEEP_ID", help="print the table of cells of a sweep")
    g.add_argument("--resume", metavar="SWEEP_ID", help="run what is missing, failed or interrupted")
    g.add_argument("--report", metavar="SWEEP_ID", help="rebuild the sweep report from the records")
    add_data(g)
    g.add_argument("--out", type=out_arg, default=DEFAULT_OUT, metavar="DIR", help="output directory (reports/)")
    g.add_argument("--yes", action="store_true", help=f"allow more than {MAX_CELLS_WITHOUT_YES} cells")
    add_quiet(g)
    g.add_argument("--no-report", action="store_true", help="no HTML report at the end")


# --- spec --------------------------------------------------------------------------------------------------------
def spec_from_args(args: argparse.Namespace) -> tuple[SweepSpec, dict]:
    """The SweepSpec (TOML, then the flags on top) and the executor settings."""
    doc: dict = {}
    base = Path.cwd()
    if args.spec:
        doc, base = load_toml(Path(args.spec))
    devices = args.device or doc.get("devices") or ["cpu"]
    flags = {"sizes": pick_sizes(args.size) if args.size else None,
             "backends": pick_backends(args.backend, device=devices[0] if isinstance(devices, list) else devices)
             if args.backend else None,
             "devices": args.device, "precision": args.precision,
             "dtype": args.dtype, "steps": args.steps, "epochs": args.epochs, "eval_interval": args.eval_interval,
             "checkpoint_every": args.checkpoint_every, "threads": args.threads, "name": args.name,
             "paired_rounds": args.paired_rounds}
    for key, value in flags.items():
        if value is not None:
            doc[key] = value
    if args.config is not None:
        doc["configs"] = [str(Path(c).resolve()) for c in listed(args.config, "--config")]
    if args.steps is not None:
        doc.pop("epochs", None)
    if args.epochs is not None:
        doc.pop("steps", None)
    if args.seed is not None and args.seeds is not None:
        raise UsageError("--seed and --seeds exclude each other; pass one (--seeds 3 or --seed 1 --seed 2)")
    if args.seeds is not None:
        doc["seeds"] = args.seeds
    if args.seed is not None:
        doc["seeds"] = args.seed
    if args.no_text:
        doc["text"] = False
    if args.set:
        doc["fields"] = dict(doc.get("fields", {}), **parse_set(args.set))
    slurm = dict(doc.get("slurm", {}))
    for key in ("partition", "gpus_per_job", "cpus_per_job", "mem_gb", "time_min"):
        if getattr(args, key) is not None:
            slurm[key] = getattr(args, key)
    if slurm.get("mem_gb") is not None and not (isinstance(slurm["mem_gb"], (int, float)) and slurm["mem_gb"] > 0):
        raise UsageError(f"mem_gb must be a positive number of GB, got {slurm['mem_gb']!r}")
    if args.sbatch:
        slurm["sbatch"] = list(slurm.get("sbatch", [])) + args.sbatch
    executor = {"kind": args.executor or doc.get("executor", "local"), "jobs": args.jobs or doc.get("jobs", 1),
                "slurm": slurm}
    if executor["kind"] not in ("local", "slurm"):
        raise UsageError(f"unknown executor {executor['kind']!r}; use local or slurm")
    if executor["kind"] == "slurm" and args.jobs:
        raise UsageError("--jobs is for the local executor; on SLURM every cell is its own job")
    if not isinstance(executor["jobs"], int) or executor["jobs"] < 1:
        raise UsageError(f"jobs must be a positive whole number, got {executor['jobs']!r}")
    doc.pop("slurm", None), doc.pop("executor", None), doc.pop("jobs", None)
    return build_spec(doc, base), executor


def validate(spec: SweepSpec, cells: list[Cell], out: Path, data: str | None) -> object:
    """Every check that can fail, for every cell, before anything is written; returns the corpus."""
    from harness.data import load_corpus

    corpus = load_corpus(data)
    seen: set[tuple] = set()
    for cell in cells:
        key = (cell.config.config_hash(), cell.backend, cell.device, tuple(sorted(cell.options.items())))
        if key in seen:
            continue
        seen.add(key)
        launch.preflight(_plan(spec, cell, corpus, out))
    return corpus


def _plan(spec: SweepSpec, cell: Cell, corpus: object, out: Path) -> launch.Plan:
    return launch.Plan(config=cell.config, corpus=corpus, backends=[cell.backend], device=cell.device,  # type: ignore[arg-type]
                       seed=cell.seed, out=out, backend_options={cell.backend: dict(cell.options)},
                       checkpoint_every=spec.checkpoint_every, text=spec.text, progress=False, threads=spec.threads)


def _cell_doc(cell: Cell, spec: SweepSpec) -> dict:
    return {"index": cell.index, "key": cell.key, "group": cell.group, "label": cell.config.name,
            "source": cell.source, "overrides": cell.overrides, "config": cell.config.to_dict(),
            "backend": cell.backend, "seed": cell.seed, "device": cell.device, "backend_options": cell.options,
            "threads": spec.threads, "run_id": None, "job_ids": [], "status": "pending", "attempts": 0,
            "contended": False}


def _config_of(cell: dict):
    from harness.config import Config

    return Config(**cell["config"])


# --- running -----------------------------------------------------------------------------------------------------
def _executor(m: mf.Manifest, progress: bool, wait: bool = True):
    ex = m.doc["executor"]
    if ex["kind"] == "slurm":
        from harness.sweep.slurm import SlurmExecutor

        s = ex.get("slurm", {})
        return SlurmExecutor(m.dir / "slurm", partition=s.get("partition"), gpus_per_job=s.get("gpus_per_job"),
                             cpus_per_job=s.get("cpus_per_job"), mem_gb=s.get("mem_gb"),
                             time_min=s.get("time_min") or 60, sbatch=s.get("sbatch"), wait=wait)
    from harness.sweep.executors import LocalExecutor

    return LocalExecutor(jobs=ex.get("jobs", 1), progress=progress)


def _run_cells(m: mf.Manifest, todo: list[dict], corpus: object, progress: bool, wait: bool,
               paired: list[dict] | None = None) -> int:
    """Give every cell of `todo` a run directory (spec.json) and run them, each block's paired timing (`paired`)
    after its last cell; the manifest follows every event."""
    spec = m.doc["spec"]
    total = len(todo)
    done, started = [0], [0]
    contended = m.doc["executor"]["kind"] == "local" and m.doc["executor"].get("jobs", 1) > 1
    for cell in todo:
        if not cell.get("run_id"):
            plan = launch.Plan(config=_config_of(cell), corpus=corpus, backends=[cell["backend"]],  # type: ignore[arg-type]
                               device=cell["device"], seed=cell["seed"], out=m.out,
                               backend_options={cell["backend"]: dict(cell["backend_options"])},
                               checkpoint_every=spec["checkpoint_every"], text=spec["text"], progress=progress,
                               threads=cell.get("threads"))
            cell["run_id"] = launch.write_spec(plan)
    for entry in paired or []:
        mf.ensure_paired_doc(m.out, entry, m.cells, spec.get("threads"))
    m.save()

    def notify(cell: dict, event: str) -> None:
        if cell.get("kind") == "paired":
            return notify_paired(cell, event)
        if event == "started":
            cell["attempts"] = cell.get("attempts", 0) + 1
            cell["status"] = "running"
            cell["contended"] = cell.get("contended") or contended
            started[0] += 1
            print(f"[{started[0]}/{total}] {cell['key']}: run {cell['run_id']}", file=sys.stderr, flush=True)
        elif event == "queued":
            cell["attempts"] = cell.get("attempts", 0) + 1
            cell["status"] = "queued"
            print(f"  queued {cell['key']} as SLURM job {cell['job_ids'][-1]}", file=sys.stderr, flush=True)
        elif event == "running":
            cell["status"] = "running"
            print(f"  running {cell['key']} (job {cell['job_ids'][-1]})", file=sys.stderr, flush=True)
        elif event == "finished":
            done[0] += 1
            state, rec = mf.record_status(m.out, cell)
            cell["status"] = "interrupted" if state == "running" else state  # a record left 'running' was killed
            info = mf.cell_summary(cell, rec)
            print(f"  {cell['key']}: {cell['status']} {info['steps']} val {info['val_loss']} "
                  f"({done[0]}/{total} done)", file=sys.stderr, flush=True)
        m.save()

    def notify_paired(entry: dict, event: str) -> None:
        if event in ("started", "queued"):
            entry["attempts"] = entry.get("attempts", 0) + 1
            entry["status"] = "running" if event == "started" else "queued"
            where = f" as SLURM job {entry['job_ids'][-1]}" if event == "queued" else ""
            print(f"  paired timing {entry['key']}{where}", file=sys.stderr, flush=True)
        elif event == "running":
            entry["status"] = "running"
        elif event == "finished":
            state, doc = mf.paired_status(m.out, entry)
            entry["status"] = "interrupted" if state == "running" else state
            from harness import paired as pt

            line = pt.headline(doc) if doc else "no record"
            print(f"  {entry['key']}: {entry['status']}; {line}", file=sys.stderr, flush=True)
        m.save()

    return _executor(m, progress, wait).run(m.out, mf.ordered(todo, paired or []), notify)


def refresh(m: mf.Manifest) -> list[dict]:
    """Each cell's state now (from squeue for SLURM jobs still alive, else from its RunRecord), set in `m` in memory."""
    alive: dict[str, str] = {}
    if m.doc["executor"]["kind"] == "slurm":
        from harness.sweep.slurm import is_alive, job_states

        ids = [c["job_ids"][-1] for c in m.cells if c.get("job_ids")]
        states = job_states(ids) or {}
        alive = {j: s for j, s in states.items() if is_alive(s)}
    rows = []
    for cell in m.cells:
        state, rec = mf.record_status(m.out, cell)
        job = cell["job_ids"][-1] if cell.get("job_ids") else ""
        if job in alive:
            state = "running" if alive[job].startswith("RUNNING") else "queued"
        elif state == "running":
            # a record still says running: its worker is alive only if this sweep's local process is running it
            state = "running" if cell.get("status") == "running" and m.doc["executor"]["kind"] == "local" \
                and _local_alive(m) else "interrupted"
        cell["status"] = state
        rows.append({"cell": cell["index"], "key": cell["key"], "status": state, "run": cell.get("run_id") or "",
                     "job": job, **mf.cell_summary(cell, rec)})
    return rows


def refresh_paired(m: mf.Manifest) -> list[dict]:
    """Each paired-timing entry's state now (from its record, and squeue for a SLURM job still alive)."""
    from harness import paired

    alive: dict[str, str] = {}
    entries = m.doc.get("paired") or []
    if m.doc["executor"]["kind"] == "slurm" and entries:
        from harness.sweep.slurm import is_alive, job_states

        states = job_states([e["job_ids"][-1] for e in entries if e.get("job_ids")]) or {}
        alive = {j: s for j, s in states.items() if is_alive(s)}
    rows = []
    for entry in entries:
        state, doc = mf.paired_status(m.out, entry)
        job = entry["job_ids"][-1] if entry.get("job_ids") else ""
        if job in alive:
            state = "running" if alive[job].startswith("RUNNING") else "queued"
        elif state == "running":
            state = "running" if entry.get("status") == "running" and m.doc["executor"]["kind"] == "local" \
                and _local_alive(m) else "interrupted"
        entry["status"] = state
        rows.append({"paired": entry["index"], "key": entry["key"], "status": state, "job": job,
                     "rounds": paired.status_text(doc) if doc else ""})
    return rows


def _local_alive(m: mf.Manifest) -> bool:
    """Whether the `harness sweep` process that owns the manifest still runs (its pid, on this host)."""
    import os
    import socket

    owner = m.doc.get("owner") or {}
    if owner.get("host") != socket.gethostname() or not owner.get("pid"):
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except (OSError, ValueError):
        return False
    return True


def _own(m: mf.Manifest) -> None:
    import os
    import socket

    m.doc["owner"] = {"pid": os.getpid(), "host": socket.gethostname()}


def print_status(m: mf.Manifest) -> dict[str, int]:
    import pandas as pd

    rows = refresh(m)
    print(f"sweep {m.sweep_id} ({m.doc['executor']['kind']}), {len(rows)} cells, under {m.out}")
    print(pd.DataFrame(rows).to_string(index=False))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("  " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    prows = refresh_paired(m)
    if prows:
        print(f"paired timing ({len(prows)}):")
        print(pd.DataFrame(prows).to_string(index=False))
    return counts


def _finish(m: mf.Manifest, code: int, no_report: bool) -> int:
    counts: dict[str, int] = {}
    for row in refresh(m):
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    pcounts: dict[str, int] = {}
    for row in refresh_paired(m):
        pcounts[row["status"]] = pcounts.get(row["status"], 0) + 1
    m.save()
    print(f"sweep {m.sweep_id}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), file=sys.stderr)
    if pcounts:
        print("paired timing: " + ", ".join(f"{v} {k}" for k, v in sorted(pcounts.items())), file=sys.stderr)
    if not no_report and counts.get("completed"):
        path = write_sweep_report(m)
        print(f"report: {path}", file=sys.stderr)
    if code == 130:
        print(f"interrupted; continue with `harness sweep --resume {m.sweep_id} --out {m.out}`", file=sys.stderr)
        return 130
    if counts.get("queued") or counts.get("running"):
        print(f"follow with `harness sweep --status {m.sweep_id} --out {m.out}`", file=sys.stderr)
        return 0
    return 0 if counts.get("completed", 0) == len(m.cells) else 1


def write_sweep_report(m: mf.Manifest) -> Path:
    from harness.report import write_index
    from harness.report.sweep import write_sweep_report as write

    path = write(m.out, m.sweep_id)
    write_index(m.out)
    return path


# --- the command -------------------------------------------------------------------------------------------------
def command(args: argparse.Namespace) -> int:
    """`harness sweep`: new sweep, --status, --resume or --report."""
    chosen = [x for x in ("status", "resume", "report") if getattr(args, x)]
    if len(chosen) > 1:
        raise UsageError(f"--{chosen[0]} and --{chosen[1]} exclude each other; pass one")
    if chosen and args.spec:
        raise UsageError(f"--{chosen[0]} takes a sweep id, not a sweep file; drop {args.spec}")
    if args.status:
        m = mf.Manifest.load(args.out, args.status)
        print_status(m)  # reads only: the sweep process that owns the manifest may be writing it
        return 0
    if args.report:
        m = mf.Manifest.load(args.out, args.report)
        records.check_writable(args.out)
        refresh(m)
        print(f"report: {write_sweep_report(m)}")
        return 0
    if args.resume:
        return resume(args)
    spec, executor = spec_from_args(args)
    cells = expand(spec)
    if len(cells) > MAX_CELLS_WITHOUT_YES and not args.yes:
        raise UsageError(f"this sweep has {len(cells)} cells (more than {MAX_CELLS_WITHOUT_YES}); pass --yes to run "
                         "them all, or shrink an axis")
    if executor["kind"] == "slurm":
        from harness.sweep.slurm import check_cluster

        check_cluster(executor["slurm"].get("partition"))
    corpus = validate(spec, cells, args.out, args.data)
    groups = len({c.group for c in cells})
    where = ("one at a time on this machine" if executor["kind"] == "local" and executor["jobs"] == 1 else
             f"{executor['jobs']} at a time on this machine (timings contended)" if executor["kind"] == "local"
             else "as SLURM jobs")
    print(f"sweep: {len(cells)} cells ({groups} groups x {len(spec.seeds)} seeds), {where}", file=sys.stderr)
    sweep_id = mf.new_sweep_id(args.out, spec.name)
    m = mf.Manifest(args.out, {
        "schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "sweep_id": sweep_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "spec": spec.to_dict(),
        "executor": executor, "data": {"path": corpus.path, "sha256": corpus.sha256},  # type: ignore[attr-defined]
        "cells": [_cell_doc(c, spec) for c in cells]})
    m.doc["paired"] = mf.paired_entries(sweep_id, m.cells, spec.paired_rounds)
    _own(m)
    m.save()
    print(f"sweep {sweep_id}: manifest {m.path}", file=sys.stderr)
    if m.doc["paired"]:
        print(f"sweep: {len(m.doc['paired'])} paired timings (each block's backends side by side after its cells, "
              f"{spec.paired_rounds} undisturbed rounds)", file=sys.stderr)
    code = _run_cells(m, m.cells, corpus, progress=not args.quiet, wait=not args.no_wait, paired=m.doc["paired"])
    return _finish(m, code, args.no_report)


def resume(args: argparse.Namespace) -> int:
    """Run the cells of a sweep that are pending, failed or interrupted (never one that completed or still runs)."""
    from harness.data import load_corpus

    m = mf.Manifest.load(args.out, args.resume)
    if m.doc["executor"]["kind"] == "slurm":
        from harness.sweep.slurm import check_cluster

        check_cluster(m.doc["executor"].get("slurm", {}).get("partition"))
    if args.jobs and m.doc["executor"]["kind"] == "local":
        m.doc["executor"]["jobs"] = args.jobs
    if _local_alive(m):
        raise UsageError(f"sweep {m.sweep_id} is still running (or waiting for its jobs) in process "
                         f"{m.doc['owner']['pid']}; wait for it or stop it first")
    corpus = load_corpus(m.doc["data"]["path"])
    if corpus.sha256 != m.doc["data"]["sha256"]:
        raise UsageError(f"data file {corpus.path!r} changed since the sweep started; restore it")
    refresh(m)
    refresh_paired(m)
    todo = [c for c in m.cells if c["status"] in mf.RERUNNABLE]
    ptodo = [e for e in m.doc.get("paired") or [] if e["status"] in mf.PAIRED_RERUNNABLE]
    busy = sum(c["status"] in ("queued", "running") for c in m.cells)
    print(f"sweep {m.sweep_id}: {len(todo)} of {len(m.cells)} cells to run"
          + (f", {len(ptodo)} paired timings" if ptodo else "")
          + (f", {busy} still queued or running (left alone)" if busy else ""), file=sys.stderr)
    _own(m)
    m.save()
    code = _run_cells(m, todo, corpus, progress=not args.quiet, wait=not args.no_wait, paired=ptodo) \
        if todo or ptodo else 0
    return _finish(m, code, args.no_report)
