"""`harness sweep`: expand a spec into cells, validate them all, run them through an executor, report.

    harness sweep --sizes small,medium --backends torch,numpy --seeds 3 --steps 300
    harness sweep grid.toml --executor slurm --partition gpu --gpus-per-job 1
    harness sweep --status SWEEP_ID
    harness sweep --resume SWEEP_ID
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from harness.cli.options import listed, pick_backends, pick_sizes
from harness.errors import UsageError
from harness.run import plan as run_plan
from harness.run import records
from harness.sweep import manifest as mf
from harness.sweep.settings import check_executor, check_text
from harness.sweep.spec import (
    MAX_CELLS_WITHOUT_YES,
    Cell,
    SweepSpec,
    build_spec,
    check_count,
    expand,
    load_toml,
    parse_seed_flag,
    parse_set,
)

ReportWriter = Callable[[Path, str], Path]  # (out, sweep id) -> the report page written

SLURM_FLAGS = ("partition", "gpus_per_job", "cpus_per_job", "mem_gb", "time_min", "array_parallelism")


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness sweep`."""
    from harness.cli.options import (
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
    from harness.config.presets import PRESETS, SIZES

    p.add_argument("spec", nargs="?", metavar="SPEC.toml", help="a sweep file (flags override its keys)")
    g = p.add_argument_group("axes (cells are the cross product)")
    add_size(g, f"size preset(s): {', '.join(PRESETS)}, or all ({', '.join(SIZES)}); repeat or comma-separate "
             "(default small)")
    g.add_argument("--config", "--configs", dest="config", action="append", metavar="FILE[,FILE...]",
                   help="TOML config files as axis values (beside or instead of --size); repeat or comma-separate")
    add_backend(g, "torch, numpy, jax, flux, or all (every backend that can run here); repeat or comma-separate "
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
    g.add_argument("--array-parallelism", type=positive_int, metavar="N",
                   help="slurm: at most N cells of the job array run at once (default: as many as the cluster allows)")
    g.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                   help="extra sbatch long option (name [a-z0-9_-]+, one line of plain text)")
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
        doc["seeds"] = parse_seed_flag(args.seeds)
    if args.seed is not None:
        doc["seeds"] = args.seed
    if args.no_text:
        doc["text"] = False
    if args.set:
        doc["fields"] = dict(doc.get("fields", {}), **parse_set(args.set))
    slurm = dict(doc.get("slurm", {}))
    for key in SLURM_FLAGS:
        if getattr(args, key) is not None:
            slurm[key] = getattr(args, key)
    if args.sbatch:
        slurm["sbatch"] = list(slurm.get("sbatch", [])) + args.sbatch
    executor = {"kind": args.executor or doc.get("executor", "local"), "jobs": args.jobs or doc.get("jobs", 1),
                "slurm": slurm}
    check_executor(executor)
    if executor["kind"] == "slurm":  # the --out path goes into the job script (#SBATCH --output, the python line)
        check_text(str(Path(args.out).resolve()), "--out")
    if executor["kind"] == "slurm" and args.jobs:
        raise UsageError("--jobs is for the local executor; on SLURM the cells are one job array "
                         "(--array-parallelism N caps how many run at once)")
    given = [f"--{k.replace('_', '-')}" for k in SLURM_FLAGS if getattr(args, k) is not None]
    given += ["--sbatch"] * bool(args.sbatch) + ["--no-wait"] * bool(args.no_wait)
    if executor["kind"] == "local" and given:
        raise UsageError(f"{given[0]} is for the SLURM executor and this sweep runs locally; add --executor slurm "
                         f"or drop {given[0]}")
    doc.pop("slurm", None), doc.pop("executor", None), doc.pop("jobs", None)
    return build_spec(doc, base), executor


def validate(spec: SweepSpec, cells: list[Cell], out: Path, data: str | None, entries: list[dict],
             jobs: int = 1) -> object:
    """Every check that can fail, for every cell and paired-timing entry (`entries`), before anything is written;
    returns the corpus.

    `jobs` workers at once (the local executor's --jobs) must fit in memory together: the `jobs` biggest cells'
    estimates are added up."""
    from harness.core.data import load_corpus

    corpus = load_corpus(data)
    plans = [_plan(spec, cell, corpus, out) for cell in cells]
    check_plans(plans, jobs)
    check_paired_memory(dict(enumerate(plans)), entries)
    return corpus


def check_plans(plans: list[run_plan.Plan], jobs: int = 1) -> None:
    """`launch.preflight` for each distinct plan, then the memory of `jobs` workers at once."""
    need: dict[tuple, int] = {}
    sizes = []
    for plan in plans:
        (backend,) = plan.backends
        key = (plan.config.config_hash(), backend, plan.device, tuple(sorted(plan.backend_options[backend].items())))
        if key not in need:
            run_plan.preflight(plan)
            need[key] = run_plan.memory_need(plan)[0]
        sizes.append(need[key])
    if jobs > 1 and len(sizes) > 1:
        together = sum(sorted(sizes, reverse=True)[:jobs])
        total, available = run_plan.machine_memory()
        if together > available:
            raise UsageError(f"{min(jobs, len(sizes))} cells at once (--jobs {jobs}) need about "
                             f"{run_plan.fmt_bytes(together)} of memory together but this machine has "
                             f"{run_plan.fmt_bytes(available)} available of {run_plan.fmt_bytes(total)}; pass a "
                             "smaller --jobs (--jobs 1 runs one cell at a time)")


def check_paired_memory(plans: dict[int, run_plan.Plan], entries: list[dict]) -> None:
    """A paired timing holds every contender of its block at once: their memory together must fit (`plans`: the
    plan of each cell index)."""
    total, available = run_plan.machine_memory()
    for entry in entries:
        together = sum(run_plan.memory_need(plans[i])[0] for i in entry["members"] if i in plans)
        if together > available:
            raise UsageError(f"the paired timing of {entry['key']} holds {len(entry['members'])} backends at once and "
                             f"needs about {run_plan.fmt_bytes(together)} of memory together but this machine has "
                             f"{run_plan.fmt_bytes(available)} available of {run_plan.fmt_bytes(total)}; make the "
                             "model smaller or pass --paired-rounds 0 (no speed verdict)")


def _plan(spec: SweepSpec, cell: Cell, corpus: object, out: Path) -> run_plan.Plan:
    return run_plan.Plan(config=cell.config, corpus=corpus, backends=[cell.backend], device=cell.device,  # type: ignore[arg-type]
                       seed=cell.seed, out=out, backend_options={cell.backend: dict(cell.options)},
                       checkpoint_every=spec.checkpoint_every, text=spec.text, progress=False, threads=spec.threads)


def _cell_doc(cell: Cell, spec: SweepSpec) -> dict:
    return {"index": cell.index, "key": cell.key, "group": cell.group, "label": cell.config.name,
            "source": cell.source, "overrides": cell.overrides, "config": cell.config.to_dict(),
            "backend": cell.backend, "seed": cell.seed, "device": cell.device, "backend_options": cell.options,
            "threads": spec.threads, "run_id": None, "job_ids": [], "status": "pending", "attempts": 0,
            "contended": False}


def _plan_of(m: mf.Manifest, cell: dict, corpus: object, progress: bool = False) -> run_plan.Plan:
    """The run plan of a stored cell (its config checked when the manifest was loaded)."""
    from harness.config.fields import config_from_dict

    spec = m.doc["spec"]
    return run_plan.Plan(config=config_from_dict(cell["config"], f"{m.path} cell {cell['index']}"),
                       corpus=corpus, backends=[cell["backend"]], device=cell["device"],  # type: ignore[arg-type]
                       seed=cell["seed"], out=m.out, backend_options={cell["backend"]: dict(cell["backend_options"])},
                       checkpoint_every=spec["checkpoint_every"] or 0, text=spec["text"], progress=progress,
                       threads=cell.get("threads"))


def _has_run(m: mf.Manifest, cell: dict) -> bool:
    """Whether the cell's run directory exists with its spec (a run id whose directory is gone gets a new run)."""
    return bool(cell.get("run_id")) and records.RunPaths(m.out, cell["run_id"]).spec.is_file()


# --- running -----------------------------------------------------------------------------------------------------
def _executor(m: mf.Manifest, progress: bool, wait: bool = True):
    ex = m.doc["executor"]
    if ex["kind"] == "slurm":
        from harness.sweep.slurm import SlurmExecutor

        return SlurmExecutor.from_settings(m.dir / "slurm", ex.get("slurm", {}), wait=wait,
                                           job_name=f"harness-{m.doc['spec'].get('name', 'sweep')}")
    from harness.sweep.executors import LocalExecutor

    return LocalExecutor(jobs=ex.get("jobs", 1), progress=progress)


def _run_cells(m: mf.Manifest, todo: list[dict], corpus: object, progress: bool, wait: bool,
               paired: list[dict] | None = None) -> int:
    """Give every cell of `todo` a run directory (spec.json) and run them, each block's paired timing (`paired`)
    after its last cell; the manifest follows every event.

    Should anything fail before a cell was started or submitted (a full disk while the specs are written, sbatch
    refusing the array), the run directories made here for those cells are removed again, so no run directory
    exists that the manifest does not list."""
    spec = m.doc["spec"]
    total = len(todo)
    done, started = [0], [0]
    contended = m.doc["executor"]["kind"] == "local" and m.doc["executor"].get("jobs", 1) > 1
    fresh: list[dict] = []  # cells given a run directory here
    begun: set[int] = set()  # cells an executor started or submitted

    def event_of(item: dict, event: str) -> None:
        """One cell's or paired entry's event, in memory (`notify` saves the manifest)."""
        entry = item.get("kind") == "paired"
        if event in ("started", "queued"):
            item["attempts"] = item.get("attempts", 0) + 1
            item["status"] = "running" if event == "started" else "queued"
            if entry:
                where = f" as SLURM job {item['job_ids'][-1]}" if event == "queued" else ""
                print(f"  paired timing {item['key']}{where}", file=sys.stderr, flush=True)
                return
            begun.add(item["index"])
            if event == "started":
                item["contended"] = item.get("contended") or contended
                started[0] += 1
                print(f"[{started[0]}/{total}] {item['key']}: run {item['run_id']}", file=sys.stderr, flush=True)
        elif event == "running":
            item["status"] = "running"
            if not entry:
                print(f"  running {item['key']} (job {item['job_ids'][-1]})", file=sys.stderr, flush=True)
        elif event == "finished":
            state, rec = (mf.paired_status if entry else mf.record_status)(m.out, item)
            item["status"] = "interrupted" if state == "running" else state  # a record left 'running' was killed
            if entry:
                from harness.timing import paired

                line = paired.headline(rec) if rec else "no record"
                print(f"  {item['key']}: {item['status']}; {line}", file=sys.stderr, flush=True)
            else:
                done[0] += 1
                info = mf.cell_summary(item, rec)
                print(f"  {item['key']}: {item['status']} {info['steps']} val {info['val_loss']} "
                      f"({done[0]}/{total} done)", file=sys.stderr, flush=True)

    def notify(items: dict | list[dict], event: str) -> None:
        for item in [items] if isinstance(items, dict) else items:
            event_of(item, event)
        m.save()  # once per call: a submitted array of 1000 cells is one write of the manifest, not 1000

    executor = _executor(m, progress, wait)
    try:
        for cell in todo:
            if not _has_run(m, cell):
                cell["run_id"] = None
                fresh.append(cell)
                cell["run_id"] = run_plan.write_spec(_plan_of(m, cell, corpus, progress))
        for entry in paired or []:
            mf.ensure_paired_doc(m.out, entry, m.cells, spec.get("threads"))
        m.save()
        return executor.run(m.out, mf.ordered(todo, paired or []), notify)
    except BaseException as exc:
        unborn = [c for c in fresh if c["index"] not in begun]
        for cell in unborn:
            if cell.get("run_id"):
                shutil.rmtree(records.run_dir(m.out, cell["run_id"]), ignore_errors=True)
            cell["run_id"] = None
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
        again = f"harness sweep --resume {m.sweep_id} --out {shlex.quote(str(m.out))}"
        super().__init__(f"  sweep {m.sweep_id} stopped: the disk is full (as the worker said above); free some "
                         f"space, then continue with `{again}`")


def _alive_jobs(m: mf.Manifest) -> dict[str, str] | None:
    """The SLURM jobs of the sweep's cells and paired entries that squeue lists as alive, with their state (one squeue
    call for both; {} for a local sweep or one without jobs); None when squeue cannot answer."""
    items = [*m.cells, *(m.doc.get("paired") or [])]
    jobs = [i["job_ids"][-1] for i in items if i.get("job_ids")]
    if m.doc["executor"]["kind"] != "slurm" or not jobs:
        return {}
    from harness.sweep.slurm import is_alive, job_states

    states = job_states(jobs)
    return None if states is None else {j: s for j, s in states.items() if is_alive(s)}


def _state_now(m: mf.Manifest, item: dict, state: str, alive: dict[str, str] | None) -> tuple[str, str]:
    """(state, job id) of a cell or paired entry now: its job's, while squeue lists it alive, else its record's
    `state`, where a record left "running" is running only if this sweep's local process is running it. When squeue
    could not answer (`alive` None), a job stored as queued or running keeps that state unless its record says it
    completed: an unanswered squeue must never make a job that still runs look gone (and be submitted again)."""
    job = item["job_ids"][-1] if item.get("job_ids") else ""
    if alive is None and job and item.get("status") in ("queued", "running") and state != mf.DONE:
        return item["status"], job
    if alive is not None and job in alive:
        return ("running" if alive[job].startswith("RUNNING") else "queued"), job
    if state == "running":
        local = item.get("status") == "running" and m.doc["executor"]["kind"] == "local" and _local_alive(m)
        state = "running" if local else "interrupted"
    return state, job


class Refreshed(NamedTuple):
    """The rows of `refresh`: one per cell, one per paired-timing entry; whether squeue answered (always, locally)."""

    cells: list[dict]
    paired: list[dict]
    squeue_answered: bool


def refresh(m: mf.Manifest) -> Refreshed:
    """Each cell's and paired-timing entry's state now (from squeue, asked once, for SLURM jobs still alive, else from
    its record), set in `m` in memory."""
    alive = _alive_jobs(m)
    return Refreshed([_refresh_item(m, c, alive) for c in m.cells],
                     [_refresh_item(m, e, alive) for e in m.doc.get("paired") or []], alive is not None)


def _refresh_item(m: mf.Manifest, item: dict, alive: dict[str, str] | None) -> dict:
    """A cell's or paired entry's state now, set in it; its row of the status table."""
    if item.get("kind") == "paired":
        from harness.timing import paired

        state, doc = mf.paired_status(m.out, item)
        item["status"], job = _state_now(m, item, state, alive)
        return {"paired": item["index"], "key": item["key"], "status": item["status"], "job": job,
                "rounds": paired.status_text(doc) if doc else ""}
    state, rec = mf.record_status(m.out, item)
    item["status"], job = _state_now(m, item, state, alive)
    return {"cell": item["index"], "key": item["key"], "status": item["status"], "run": item.get("run_id") or "",
            "job": job, **mf.cell_summary(item, rec)}


def _counts(rows: list[dict]) -> dict[str, int]:
    """How many rows are in each state."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts


SQUEUE_SILENT = "squeue did not answer: the states of queued or running jobs are as last recorded"


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
    """Print the table of cells and of paired timings; returns how many cells are in each state."""
    import pandas as pd

    rows, prows, answered = refresh(m)
    print(f"sweep {m.sweep_id} ({m.doc['executor']['kind']}), {len(rows)} cells, under {m.out}")
    print(pd.DataFrame(rows).to_string(index=False))
    counts = _counts(rows)
    print("  " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if prows:
        print(f"paired timing ({len(prows)}):")
        print(pd.DataFrame(prows).to_string(index=False))
    if not answered:
        print(f"{SQUEUE_SILENT}; ask again later", file=sys.stderr)
    return counts


def _finish(m: mf.Manifest, code: int, write_report: ReportWriter | None) -> int:
    rows, prows, answered = refresh(m)
    counts, pcounts = _counts(rows), _counts(prows)
    m.save()
    print(f"sweep {m.sweep_id}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), file=sys.stderr)
    if pcounts:
        print("paired timing: " + ", ".join(f"{v} {k}" for k, v in sorted(pcounts.items())), file=sys.stderr)
    if not answered:
        print(SQUEUE_SILENT, file=sys.stderr)
    if write_report is not None and counts.get("completed"):
        path = write_report(m.out, m.sweep_id)
        print(f"report: {path}", file=sys.stderr)
    again = f"`harness sweep --resume {m.sweep_id} --out {shlex.quote(str(m.out))}`"
    if code == 130:
        print(f"interrupted; continue with {again}", file=sys.stderr)
        return 130
    if counts.get("queued") or counts.get("running"):
        print(f"follow with `harness sweep --status {m.sweep_id} --out {shlex.quote(str(m.out))}`", file=sys.stderr)
        return 0
    rerun = [f"{counts[k]} {k}" for k in mf.RERUNNABLE if counts.get(k)]
    if rerun:  # e.g. a cell whose job was cancelled: say how to go on (it continues from its checkpoint)
        print(f"{', '.join(rerun)}: run them again (each from its last checkpoint) with {again}", file=sys.stderr)
    return 0 if counts.get("completed", 0) == len(m.cells) else 1


# --- the command -------------------------------------------------------------------------------------------------
def command(args: argparse.Namespace) -> int:
    """`harness sweep`: new sweep, --status, --resume or --report.

    `args.write_report(out, sweep_id) -> Path` writes the sweep's HTML report: the reports sit above the sweeps
    (they read sweep manifests), so the command line hands their writer in (harness.cli.main)."""
    chosen = [x for x in ("status", "resume", "report") if getattr(args, x) is not None]
    if len(chosen) > 1:
        raise UsageError(f"--{chosen[0]} and --{chosen[1]} exclude each other; pass one")
    if chosen and args.spec:
        raise UsageError(f"--{chosen[0]} takes a sweep id, not a sweep file; drop {args.spec}")
    for option in chosen:  # an empty id (an unset shell variable) is an error, never a new sweep
        mf.check_sweep_id(getattr(args, option), args.out)
    if args.status is not None:
        m = mf.Manifest.load(args.out, args.status)
        print_status(m)  # reads only: the sweep process that owns the manifest may be writing it
        return 0
    if args.report is not None:
        m = mf.Manifest.load(args.out, args.report)
        records.check_writable(args.out)
        refresh(m)
        print(f"report: {args.write_report(m.out, m.sweep_id)}")
        return 0
    if args.resume is not None:
        return resume(args)
    spec, executor = spec_from_args(args)
    check_count(spec, args.yes)  # by arithmetic: nothing is built for a sweep that is refused for its size
    cells = expand(spec)
    slurm = None
    if executor["kind"] == "slurm":
        from harness.sweep.slurm import SlurmExecutor, check_cluster

        check_cluster(executor["slurm"].get("partition"))
        slurm = SlurmExecutor.from_settings(Path(args.out).resolve() / "sweeps" / "ID" / "slurm", executor["slurm"],
                                            job_name=f"harness-{spec.name}")
    cell_docs = [_cell_doc(c, spec) for c in cells]
    entries = mf.paired_entries("ID", cell_docs, spec.paired_rounds)  # their paths name the sweep once it has an id
    corpus = validate(spec, cells, args.out, args.data, entries,
                      jobs=executor["jobs"] if executor["kind"] == "local" else 1)
    if slurm is not None:  # sbatch --test-only: what sbatch would refuse, refused now
        slurm.check_submission(len(cells), (len(entries), max((len(e["members"]) for e in entries), default=0)))
    groups = len({c.group for c in cells})
    where = ("one at a time on this machine" if executor["kind"] == "local" and executor["jobs"] == 1 else
             f"{executor['jobs']} at a time on this machine (timings contended)" if executor["kind"] == "local"
             else "as a SLURM job array")
    print(f"sweep: {len(cells)} cells ({groups} groups x {len(spec.seeds)} seeds), {where}", file=sys.stderr)
    before = _existing(args.out, corpus)
    sweep_id = mf.new_sweep_id(args.out, spec.name)
    m = mf.Manifest(args.out, {
        "schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "sweep_id": sweep_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "spec": spec.to_dict(),
        "executor": executor, "data": {"path": corpus.path, "sha256": corpus.sha256},  # type: ignore[attr-defined]
        "cells": cell_docs})
    for entry in entries:
        entry["path"] = mf.paired_path(sweep_id, entry["index"])
    m.doc["paired"] = entries
    _own(m)
    try:
        m.save()
        print(f"sweep {sweep_id}: manifest {m.path}", file=sys.stderr)
        if m.doc["paired"]:
            print(f"sweep: {len(m.doc['paired'])} paired timings (each block's backends side by side after its "
                  f"cells, {spec.paired_rounds} undisturbed rounds)", file=sys.stderr)
        code = _run_cells(m, m.cells, corpus, progress=not args.quiet, wait=not args.no_wait, paired=m.doc["paired"])
    except DiskFull as exc:
        print(exc, file=sys.stderr)
        return 2
    except (UsageError, OSError):
        if not any(c.get("attempts") for c in m.cells):  # nothing ran or was submitted: leave nothing behind
            _discard(m, before)
        raise
    return _finish(m, code, None if args.no_report else args.write_report)


def _existing(out: Path, corpus: object) -> set[Path]:
    """The paths a new sweep may create (its --out, runs/, sweeps/, data/, the corpus copy) that exist already."""
    out = Path(out)
    paths = [out, out / "runs", out / "sweeps", out / "data", records.corpus_copy(out, corpus.sha256)]  # type: ignore[attr-defined]
    return {p for p in paths if p.exists()}


def _discard(m: mf.Manifest, before: set[Path]) -> None:
    """Remove a new sweep that never started a cell: its run directories, its manifest and what it created."""
    for cell in m.cells:
        if cell.get("run_id"):
            shutil.rmtree(records.run_dir(m.out, cell["run_id"]), ignore_errors=True)
    shutil.rmtree(m.dir, ignore_errors=True)
    out = Path(m.out)
    copy = records.corpus_copy(out, m.doc["data"]["sha256"])
    if copy not in before:
        with contextlib.suppress(OSError):
            copy.unlink()
    for path in (out / "runs", out / "sweeps", out / "data", out):
        if path not in before:
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty


def resume(args: argparse.Namespace) -> int:
    """Run the cells of a sweep that are pending, failed or interrupted (never one that completed or still runs).

    Every cell to run is checked again (config, backend, device, options, memory, and on SLURM `sbatch --test-only`)
    before a run directory is made for it or anything is submitted."""
    from harness.core.data import load_corpus

    m = mf.Manifest.load(args.out, args.resume)  # schema, executor settings and cell configs checked
    ex = m.doc["executor"]
    if args.jobs and ex["kind"] == "local":
        ex["jobs"] = args.jobs
    elif args.jobs:
        raise UsageError(f"--jobs is for the local executor and sweep {m.sweep_id} runs on SLURM; drop --jobs")
    if _local_alive(m):
        raise UsageError(f"sweep {m.sweep_id} is still running (or waiting for its jobs) in process "
                         f"{m.doc['owner']['pid']}; wait for it or stop it first")
    if ex["kind"] == "slurm":
        from harness.sweep.slurm import check_cluster

        check_cluster(ex.get("slurm", {}).get("partition"))
    corpus = load_corpus(m.doc["data"]["path"])
    if corpus.sha256 != m.doc["data"]["sha256"]:
        raise UsageError(f"data file {corpus.path!r} changed since the sweep started; restore it")
    if not refresh(m).squeue_answered:  # which jobs still run is unknown: submitting now could run a cell twice
        raise UsageError(f"squeue did not answer, so whether the jobs of sweep {m.sweep_id} still run is unknown and "
                         "nothing is submitted again; retry this --resume once squeue answers")
    todo = [c for c in m.cells if c["status"] in mf.RERUNNABLE]
    ptodo = [e for e in m.doc.get("paired") or [] if e["status"] in mf.PAIRED_RERUNNABLE]
    check_plans([_plan_of(m, c, corpus) for c in todo], ex.get("jobs", 1) if ex["kind"] == "local" else 1)
    check_paired_memory({i: _plan_of(m, m.cells[i], corpus) for e in ptodo for i in e["members"]}, ptodo)
    if (todo or ptodo) and ex["kind"] == "slurm":
        _executor(m, progress=False).check_submission(
            len(todo), (len(ptodo), max((len(e["members"]) for e in ptodo), default=0)))
    busy = sum(c["status"] in ("queued", "running") for c in m.cells)
    print(f"sweep {m.sweep_id}: {len(todo)} of {len(m.cells)} cells to run"
          + (f", {len(ptodo)} paired timings" if ptodo else "")
          + (f", {busy} still queued or running (left alone)" if busy else ""), file=sys.stderr)
    _own(m)
    m.save()
    try:
        code = _run_cells(m, todo, corpus, progress=not args.quiet, wait=not args.no_wait, paired=ptodo) \
            if todo or ptodo else 0
    except DiskFull as exc:
        print(exc, file=sys.stderr)
        return 2
    return _finish(m, code, None if args.no_report else args.write_report)
