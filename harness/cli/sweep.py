"""`harness sweep`: its options, and the sweep spec they make (a sweep file's keys, the flags on top); the sweep
itself is harness.sweep.drive.

    harness sweep --size small,medium --backend torch,numpy --seeds 3 --steps 300
    harness sweep --axis n_embd=16,32,64 --backend torch,numpy --steps 300
    harness sweep grid.toml --executor slurm --partition gpu --gpus-per-job 1
    harness status SWEEP_ID            (also harness resume SWEEP_ID, harness report SWEEP_ID)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from harness.backends import DEFAULT_BACKEND
from harness.cli.options import (
    CHECKPOINT_HELP,
    CONFIG_HELP,
    DROPOUT_HELP,
    DTYPE_DETAIL,
    JOBS_HELP,
    NO_REPORT_HELP,
    NO_TEXT_HELP,
    NO_WAIT_HELP,
    SEEDS_HELP,
    SET_HELP,
    add_backend,
    add_data,
    add_device,
    add_dtype,
    add_json,
    add_out,
    add_paired,
    add_precision,
    add_quiet,
    add_schedule,
    add_seed,
    add_size,
    add_threads,
    common_device,
    exit_statuses,
    listed,
    parse_devices,
    pick_backends,
    pick_sizes,
    positive_int,
    shared,
)
from harness.errors import UsageError
from harness.sweep.settings import check_executor, check_text
from harness.sweep.spec import MAX_CELLS_WITHOUT_YES, SweepSpec, build_spec, load_toml, parse_seed_flag, parse_set

SLURM_FLAGS = ("partition", "gpus_per_job", "cpus_per_job", "mem_gb", "time_min", "array_parallelism")
# `--axis NAME=V1,V2` names a config field, or one of these axes of the sweep file's top level
TOP_AXES = {"device": "devices", "precision": "precision", "dtype": "dtype"}
SWEEP_EXIT = {0: "every cell completed (with --no-wait: every cell submitted)",
              1: "a cell failed or was interrupted; `harness resume SWEEP_ID` runs it again"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness sweep`."""
    p.add_argument("spec", nargs="?", metavar="SPEC.toml", help="a sweep file (flags override its keys)")
    g = p.add_argument_group("axes (cells are the cross product)")
    add_size(g, "one or more, repeated or comma-separated: an axis (default small)")
    g.add_argument("--config", "--configs", dest="config", action="append", metavar="FILE[,FILE...]",
                   help=shared(CONFIG_HELP, "one or more, repeated or comma-separated: an axis beside or instead of "
                               "--size"))
    add_backend(g, f"an axis (default {DEFAULT_BACKEND})")
    add_seed(g, "repeatable: the seed axis (default 1337), or --seeds", action="append", default=None)
    g.add_argument("--seeds", metavar="N|S1,S2", help=shared(SEEDS_HELP, "or a list S1,S2 (default 1)"))
    g.add_argument("--axis", action="append", default=[], metavar="NAME=V1,V2",
                   help="an axis and its values (repeatable): a config field or nanoGPT's name for one, e.g. --axis "
                        "learning_rate=0.003,0.01 (d_hidden follows n_embd unless it is an axis too), or device, "
                        "precision or dtype, e.g. --axis device=cpu,cuda")
    g = p.add_argument_group("every cell")
    add_set(g)
    add_device(g, "default cpu; a device axis: --axis device=cpu,cuda")
    add_precision(g, "%(precision_backends)s (default fp32; an axis: --axis precision=fp32,tf32)")
    add_dtype(g, f"{DTYPE_DETAIL}; an axis: --axis dtype=float32,float64")
    add_schedule(g)
    g.add_argument("--dropout", type=float, metavar="P", help=shared(DROPOUT_HELP, "every cell (default: the "
                   "preset's; an axis: --axis dropout=0,0.1)"))
    g.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help=shared(CHECKPOINT_HELP, "an interrupted or requeued cell resumes there"))
    add_threads(g)
    g.add_argument("--no-text", action="store_true", help=NO_TEXT_HELP)
    add_paired(g, None)
    g.add_argument("--name", metavar="NAME", help="a name for the sweep (part of its id)")
    g = p.add_argument_group("executor")
    g.add_argument("--executor", choices=("local", "slurm"), help="local (default): this machine; slurm: submitit")
    g.add_argument("--jobs", type=positive_int, metavar="N", help=JOBS_HELP)
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
    g.add_argument("--no-wait", action="store_true", help=NO_WAIT_HELP)
    g = p.add_argument_group("other")
    add_data(g)
    add_out(g)
    g.add_argument("--yes", action="store_true", help=f"allow more than {MAX_CELLS_WITHOUT_YES} cells")
    add_quiet(g)
    add_json(g, "the sweep's id, manifest, cells' states and report (without it stdout holds the sweep's id)")
    g.add_argument("--no-report", action="store_true", help=NO_REPORT_HELP)
    exit_statuses(p, SWEEP_EXIT)


def add_set(g: argparse._ArgumentGroup) -> None:
    """`--set NAME=VALUE`: one config value for every cell, as in every command (a comma list, its spelling from
    before `--axis`, still makes an axis)."""
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=shared(SET_HELP, "every cell"))


# --- spec --------------------------------------------------------------------------------------------------------
def _axes(args: argparse.Namespace, doc: dict) -> None:
    """--set, --dropout and --axis into `doc` (the sweep file's keys): config fields under `fields`,
    device/precision/dtype at the top level; a name given twice (in any of them) is an error, and so is a list of
    values in --set (an axis is --axis)."""
    fields = parse_set(args.set, "--set") if args.set else {}
    for name, values in fields.items():
        if len(values) > 1:
            raise UsageError(f"--set {name}= takes one value for every cell; for an axis of several pass --axis "
                             f"{name}={','.join(map(str, values))}")
    if args.dropout is not None:
        if "dropout" in fields:
            raise UsageError("--dropout and --set dropout= both given; pass one")
        fields["dropout"] = [args.dropout]
    for name, values in parse_set(args.axis, "--axis").items():
        if name in fields:
            given = "--dropout" if name == "dropout" and args.dropout is not None else f"--set {name}"
            raise UsageError(f"{given} and --axis {name} both given; list every value in one --axis "
                             f"{name}=V1,V2")
        if name in TOP_AXES:
            doc[TOP_AXES[name]] = [str(v) for v in values]
        else:
            fields[name] = values
    if fields:
        doc["fields"] = dict(doc.get("fields", {}), **fields)


def _devices(args: argparse.Namespace, doc: dict) -> None:
    """--device into `doc`: a plain device for every cell, NAME=DEVICE for one backend's cells (backend_devices); a
    device axis is --axis device=cpu,cuda."""
    values = args.device or []
    if not values:
        return
    for value in values:
        if "," in value and "=" not in value:
            raise UsageError(f"--device {value}: one device for every cell; for a device axis pass --axis "
                             f"device={value}")
    backends = doc.get("backends") or [DEFAULT_BACKEND]
    common, devices = parse_devices(values, backends if isinstance(backends, list) else [backends])
    doc["devices"] = [common]
    named = {b: d for b, d in devices.items() if d != common}
    if named:
        doc["backend_devices"] = named


def spec_from_args(args: argparse.Namespace) -> tuple[SweepSpec, dict]:
    """The SweepSpec (TOML, then the flags on top) and the executor settings."""
    doc: dict = {}
    base = Path.cwd()
    if args.spec:
        doc, base = load_toml(Path(args.spec))
    devices = doc.get("devices") or ["cpu"]
    device = common_device(args.device) if args.device else devices[0] if isinstance(devices, list) else devices
    flags = {"sizes": pick_sizes(args.size) if args.size else None,
             "backends": pick_backends(args.backend, device=device) if args.backend else None,
             "precision": None if args.precision is None else [args.precision],
             "dtype": None if args.dtype is None else [args.dtype],
             "steps": args.steps, "epochs": args.epochs, "eval_interval": args.eval_interval,
             "checkpoint_every": args.checkpoint_every, "threads": args.threads, "name": args.name,
             "paired_rounds": args.paired_rounds}
    for key, value in flags.items():
        if value is not None:
            doc[key] = value
    _devices(args, doc)
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
    _axes(args, doc)
    executor = _executor(args, doc)
    doc.pop("slurm", None), doc.pop("executor", None), doc.pop("jobs", None)
    return build_spec(doc, base), executor


def _executor(args: argparse.Namespace, doc: dict) -> dict:
    """The executor settings: the sweep file's, the flags on top, checked (and SLURM flags refused locally)."""
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
    return executor


# --- the command -------------------------------------------------------------------------------------------------
def command(args: argparse.Namespace) -> int:
    """`harness sweep`: a new sweep (harness.sweep.drive.start); `harness status|resume|report SWEEP_ID` follow it.

    `args.write_report(out, sweep_id) -> Path` writes the sweep's HTML report: the reports sit above the sweeps
    (they read sweep manifests), so the command line hands their writer in (harness.cli.main)."""
    from harness.sweep import drive

    spec, executor = spec_from_args(args)
    return drive.start(spec, executor, args.out, args.data, yes=args.yes, progress=not args.quiet,
                       wait=not args.no_wait, write_report=None if args.no_report else args.write_report,
                       result=say_result("sweep", args))


def say_result(command: str, args: argparse.Namespace) -> Callable[[dict], None]:
    """What a sweep prints on stdout when it ends (docs/usage.md, "Scripting"): its id, or with --json one object
    (the id, its manifest, how many cells and paired timings are in each state, the report)."""
    from harness.cli.options import print_json

    def say(result: dict) -> None:
        if getattr(args, "json", False):
            print_json(command, result.pop("exit_status"), out=str(args.out), **result)
        else:
            print(result["id"], flush=True)
    return say
