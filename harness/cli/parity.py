"""`harness parity`: its options, and the command that runs both workers and compares them.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from harness.backends import PARITY_DEFAULT
from harness.cli.options import (
    DROPOUT_HELP,
    PER_PARAMETER_HELP,
    STEPS_HELP,
    add_backend,
    add_json,
    add_quiet,
    add_threads,
    configure,
    exit_statuses,
    pick_sizes,
    print_json,
    result_stream,
    shared,
)
from harness.errors import UsageError
from harness.parity import record as parity_record
from harness.parity.format import format_gradients, format_optimizer, format_table
from harness.parity.record import (
    DEFAULT_OPT_STEPS,
    DEFAULT_STEPS,
    EXIT_CRASH,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_USAGE,
    ParityPlan,
)
from harness.parity.result import ParityResult
from harness.parity.tolerances import (
    TOL_KEYS,
    Tolerances,
    default_tolerances,
    precision_pair,
    reference_backend,
    tolerances_for,
)
from harness.store import ParityOptions, RunPaths, RunRecord
from harness.store.parity import ParityRecord

DEFAULT_BACKENDS = ",".join(PARITY_DEFAULT)


PARITY_EXIT = {EXIT_PASS: "pass: every check within its tolerance",
               EXIT_FAIL: "FAIL: both backends ran and differ beyond a tolerance (the table and the FAIL lines say "
                          "where)",
               EXIT_USAGE: "bad input: one line on stderr, nothing run (or a backend refused its input)",
               EXIT_CRASH: "a backend crashed or left no result, or its probe is unreadable: nothing was compared "
                           "(parity.json: verdict \"error\")",
               EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM)"}


def _float(text: str) -> float:
    # parsed loosely here, validated in `command` (a UsageError: one line, exit 2, nothing written)
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `harness parity` (the common --size/--config/--set/--data/--device/--seed/--out/--dtype are added
    by the CLI), and the exit statuses in its --help."""
    exit_statuses(p, PARITY_EXIT)
    add_backend(p, f"exactly two, in the order the report names them, e.g. --backend {PARITY_DEFAULT[0]} --backend "
                f"{PARITY_DEFAULT[1]} (default {DEFAULT_BACKENDS})")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=shared(STEPS_HELP, f"every step's loss is compared ({DEFAULT_STEPS})"))
    p.add_argument("--tol-logits", type=_float, metavar="X",
                   help="max abs difference of the step-0 logits (default: measured per precision pair and size, "
                        "see docs/parity.md)")
    p.add_argument("--tol-grad", type=_float, metavar="X",
                   help="max relative error of any parameter's step-0 gradient (default: measured)")
    p.add_argument("--tol-loss", type=_float, metavar="X",
                   help="max abs difference of the per-step training loss and the final val loss "
                        "(default: measured)")
    p.add_argument("--tol-opt", type=_float, metavar="X",
                   help="max relative error of any parameter's update or AdamW moment after each re-synchronised "
                        "step (default: measured)")
    p.add_argument("--tol-taps", type=_float, metavar="X",
                   help="max abs difference of a step-0 activation tap relative to the tap's largest value "
                        "(default: measured)")
    p.add_argument("--tol-step-loss", type=_float, metavar="X",
                   help="max abs difference of a re-synchronised step's loss, both backends from the same state "
                        "(default: measured)")
    p.add_argument("--opt-steps", type=int, default=DEFAULT_OPT_STEPS, metavar="K",
                   help="training steps whose optimizer step is re-synchronised and compared: the first K (default: "
                        "every step); each costs the non-reference backend one more training step")
    p.add_argument("--dropout", type=_float, default=0.0, metavar="P",
                   help=shared(DROPOUT_HELP, "with P > 0 the harness draws every mask and hands the same masks to "
                                             "both backends (default 0)"))
    add_threads(p, "default 1, unlike run and sweep: one thread fixes every reduction's order, so a rerun gives "
                "bit-identical numbers (parity times nothing)", type=int, default=1)
    p.add_argument("--per-parameter", action="store_true", help=PER_PARAMETER_HELP)
    add_quiet(p)
    add_json(p, "the run id, the verdict, its FAIL lines and parity.json's path (the table then goes to stderr)")


def parse_backends(values: str | list[str] | None) -> list[str]:
    """The two backend names of --backend (repeated or comma-separated; default torch,numpy); UsageError for
    anything else."""
    from harness.cli.options import pick_backends

    names = pick_backends(values if values else DEFAULT_BACKENDS, repeats=True)
    text = ",".join(names)
    if len(names) != 2:
        raise UsageError(f"--backend {text}: parity compares exactly two backends, got {len(names)}; "
                         f"pass two, e.g. --backend {PARITY_DEFAULT[0]} --backend {PARITY_DEFAULT[1]}")
    if names[0] == names[1]:
        raise UsageError(f"--backend {text}: the same backend twice; compare two different backends "
                         "(use --dtype to vary precision)")
    return names


def backend_dtype(name: str, requested: str | None) -> tuple[str, dict]:
    """The dtype backend `name` will compute in and the options that ask for it: --dtype where given (the preflight
    refuses a dtype the backend does not declare), else the default its declaration names."""
    from harness.backends import declaration

    if requested:
        return requested, {"dtype": requested}
    return declaration(name).default_dtype, {}


def resolve_tolerances(args: argparse.Namespace, pair: str, config: Any = None) -> tuple[Tolerances, dict[str, str]]:
    """Command-line tolerances over the measured defaults of `pair` for the run's `config`
    (harness.parity.tolerances.tolerances_for: its preset's, with tied embeddings those measured so, or the loosest
    for a config of one's own, a preset changed by --set beyond what was measured); also says where each came from.
    Without `config`, from the command line alone: the --size preset's, the loosest with --config or --set."""
    if config is not None:
        base, what = tolerances_for(pair, config)
        why = ", --set changes the preset" if getattr(args, "set", None) and what.startswith("loosest") else ""
        where = f"default ({pair} pair, {what}{why})"
    else:
        size = None if getattr(args, "config", None) or getattr(args, "set", None) else getattr(args, "size", None)
        base = default_tolerances(pair, size)
        why = ", --set changes the preset" if getattr(args, "set", None) else ""
        where = (f"default ({pair} pair, {size} preset)" if size else
                 f"default ({pair} pair, loosest over the presets{why})")
    chosen, source = {}, {}
    for key in TOL_KEYS:
        given = getattr(args, f"tol_{key}", None)
        chosen[key] = getattr(base, key) if given is None else given
        source[key] = where if given is None else "command line"
    tol = Tolerances(**chosen)
    tol.validate()
    return tol, source


def command(args: argparse.Namespace) -> int:
    """`harness parity`: plan (everything validated before anything is written), run both workers, load their
    records and probes, compare, write parity.json, print. The exit status says how it ended (0 pass, 1 numerical
    FAIL, 2 bad input, 3 a backend crashed, 130 interrupted; --help lists them)."""
    from harness.run import plan as run_plan
    from harness.run import supervise
    from harness.run.probe import ProbeUnreadable
    from harness.store import load_run

    pp = plan_parity(args)
    paths = run_plan.write_spec(pp.plan)
    print(_headline(pp, paths.run_id), file=sys.stderr)
    # the reference first: the other backend reads its states from the reference's probe
    codes = supervise.execute(paths, [pp.reference, pp.other], progress=pp.plan.progress,
                              threads=pp.plan.threads, chained=True)
    record = parity_record.new_record(pp, paths, codes)
    crashed = parity_record.crash(pp, codes)
    if crashed is not None:
        reason, status = crashed
        # a worker that refused its input (exit 2): if that was the probe of the one before, that one left no usable
        # result, a crash of that backend
        broken = parity_record.unreadable_probe(pp, paths, codes) if status == EXIT_USAGE else None
        if broken:
            reason, status = broken, EXIT_CRASH
        return _error(args, paths, record, reason, status, "; nothing compared (see the messages above)")

    _, recs = load_run(paths)
    workers = {rec.backend: rec for rec in recs}
    _adopt_dtypes(args, pp, workers, record)
    missing = [n for n in pp.backends if not paths.probe(n).is_file()]
    if missing:
        return _error(args, paths, record, f"no step-0 probe from {', '.join(missing)}", EXIT_CRASH,
                      "; nothing compared")
    try:
        result = parity_record.compare_workers(pp, workers, paths)
    except ProbeUnreadable as exc:  # a backend that left no usable result: a crash, never a FAIL of the model
        return _error(args, paths, record, str(exc), EXIT_CRASH, "; nothing compared")
    parity_record.finish_record(record, pp, result, workers)
    record.dump(paths)

    out = result_stream(args)
    _print_result(result, pp, getattr(args, "per_parameter", False), out)
    return _said(args, paths, record, EXIT_PASS if result.passed else EXIT_FAIL)


def _said(args: argparse.Namespace, paths: RunPaths, record: ParityRecord, status: int) -> int:
    """The last line of the result (where parity.json is) and the check's page, or with --json the result as one
    object; `status`."""
    print(f"parity record: {paths.parity}", file=result_stream(args))
    page = _write_page(paths)
    if getattr(args, "json", False):
        print_json("parity", status, id=paths.run_id, dir=paths.dir, record=paths.parity, report=page,
                   verdict=record.verdict, failures=record.failures, backends=record.backends, dtypes=record.dtypes)
    return status


def _write_page(paths: RunPaths) -> Path | None:
    """The parity check's page and the index, as `harness run` writes its report (its path on stderr); the page's
    path. The exit status stays the parity verdict's: a page that cannot be written is a note."""
    from harness.cli.run import write_reports

    try:
        return write_reports(paths.out, [paths.run_id], quiet_disk_error=True)
    except UsageError as exc:
        print(f"  no report: {exc}", file=sys.stderr)
        return None


def plan_parity(args: argparse.Namespace) -> ParityPlan:
    """The parity run of the command line, every option checked (UsageError: one line, exit 2, nothing written) and
    the workers' plan through the run preflight (memory, backends that load)."""
    from harness.cli.options import parse_devices
    from harness.core.data import load_corpus
    from harness.run import plan as run_plan

    backends = parse_backends(args.backend)
    check_parity_methods(backends)
    args.size = pick_sizes(args.size, one=True)[0]
    asked, dropout, threads = _check_numbers(args)
    dtypes, options = {}, {}
    for name in backends:
        dtypes[name], options[name] = backend_dtype(name, args.dtype)
        options[name].update(parity_options(name))  # torch: single-tensor AdamW, math attention on CUDA
    device, devices = parse_devices(args.device, backends)  # --device DEVICE or NAME=DEVICE (repeatable)
    pair = precision_pair(*(dtypes[n] for n in backends))
    config = configure(args, args.size, changes={"dropout": dropout, "steps": args.steps})
    tolerances, tol_source = resolve_tolerances(args, pair, config)
    corpus = load_corpus(args.data)
    opt_k = parity_record.optimizer_steps(config, corpus.vocab_size, args.steps, asked)
    plan = run_plan.Plan(config=config, corpus=corpus, backends=backends, device=device, seed=args.seed,
                         out=args.out, backend_options=options, text=False,
                         parity=ParityOptions(opt_steps=opt_k, reference=reference_backend(backends)),
                         progress=not getattr(args, "quiet", False), threads=threads, devices=devices)
    try:
        run_plan.preflight(plan)
    except ImportError as exc:  # a registered backend whose module or framework is not installed
        raise UsageError(f"a backend cannot be loaded ({exc}); see `harness doctor`") from None
    return ParityPlan(plan=plan, steps=args.steps, dropout=dropout, dtypes=dtypes, pair=pair, tolerances=tolerances,
                      tol_source=tol_source, budgeted=asked is None)


def _check_numbers(args: argparse.Namespace) -> tuple[int | None, float, int | None]:
    """--steps, --opt-steps, --dropout and --threads checked; (the optimizer steps asked for, dropout, threads)."""
    if not isinstance(args.steps, int) or args.steps <= 0:
        raise UsageError(f"--steps must be a positive whole number, got {args.steps!r}")
    opt_k = getattr(args, "opt_steps", DEFAULT_OPT_STEPS)
    if opt_k is not None and (not isinstance(opt_k, int) or opt_k < 0):
        raise UsageError(f"--opt-steps must be a whole number >= 0, got {opt_k!r}")
    dropout = getattr(args, "dropout", 0.0) or 0.0
    if not (math.isfinite(dropout) and 0.0 <= dropout < 1.0):
        raise UsageError(f"--dropout must be a number in [0, 1), got {dropout!r}")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be a positive whole number, got {threads!r}")
    return opt_k, dropout, threads


def _headline(pp: ParityPlan, run_id: str) -> str:
    """The line that says what is about to run: config, steps, dropout, the two backends and what is re-synchronised."""
    a, b = pp.backends
    opt_k, steps = pp.opt_steps, pp.steps
    drop = f"dropout {pp.dropout:g} (shared masks)" if pp.dropout else "dropout 0"
    sync = (f"optimizer steps 1..{opt_k} re-synchronised: {pp.other} takes each from {pp.reference}'s state"
            + (f" (the first {opt_k} of {steps}: the probe's memory budget; --opt-steps K for more)"
               if pp.budgeted and opt_k < steps else "") if opt_k else "optimizer steps not compared")
    return (f"parity {run_id}: {pp.plan.config.name}, {steps} steps, {drop}, {a} ({pp.dtypes[a]}) vs {b} "
            f"({pp.dtypes[b]}) on {' / '.join(pp.plan.devices[n] for n in pp.backends)}; {sync}")


def _error(args: argparse.Namespace, paths: RunPaths, record: ParityRecord, reason: str, status: int,
           said: str) -> int:
    """Nothing compared: parity.json with verdict "error", the reason on stderr (`said` after it), `status`."""
    parity_record.mark_error(record, reason)
    record.dump(paths)
    print(f"ERROR: {reason}{said}", file=sys.stderr)
    return _said(args, paths, record, status)


def _adopt_dtypes(args: argparse.Namespace, pp: ParityPlan, workers: dict[str, RunRecord],
                  record: ParityRecord) -> None:
    """What each backend says it computed in wins over what it was asked for; a precision pair that changes so
    brings its own tolerances (command-line ones stay), into `pp` and `record`."""
    for name in pp.backends:
        actual = workers[name].backend_info.get("dtype")
        if isinstance(actual, str) and actual != pp.dtypes[name]:
            pp.dtypes[name] = actual
    if precision_pair(*(pp.dtypes[n] for n in pp.backends)) != pp.pair:
        pp.pair = precision_pair(*(pp.dtypes[n] for n in pp.backends))
        pp.tolerances, pp.tol_source = resolve_tolerances(args, pp.pair, pp.plan.config)
        record.precision_pair, record.tolerances = pp.pair, asdict(pp.tolerances)
        record.tolerance_source = pp.tol_source


def _print_result(result: ParityResult, pp: ParityPlan, per_parameter: bool, out: TextIO) -> None:
    """The summary table (with `per_parameter`, every parameter's errors too), the FAIL lines and notes, PASS; into
    `out`."""
    print(format_table(result), file=out)
    if per_parameter:
        print(file=out)
        print(format_gradients(result), file=out)
        if result.opt_rel_err:
            print(file=out)
            print(format_optimizer(result), file=out)
    for line in result.failures:
        print(line, file=out)
    for line in result.notes:
        print(line, file=out)
    if result.passed:
        a, b = pp.backends
        print(f"PASS: {a} ({pp.dtypes[a]}) and {b} ({pp.dtypes[b]}) agree within tolerance over {result.loss_steps} "
              "steps", file=out)


def parity_options(name: str) -> dict:
    """Constructor options backend `name` takes in parity mode: parity=True where it declares the option "parity"
    (torch: the single-tensor AdamW and, on CUDA, the math attention kernel)."""
    from harness.backends import declaration

    return {"parity": True} if "parity" in declaration(name).options else {}


def check_parity_methods(backends: list[str]) -> None:
    """UsageError unless every backend declares what parity calls beyond the protocol: its step-0 gradients."""
    from harness.backends import declaration

    for name in backends:
        if "gradients" not in declaration(name).methods:
            raise UsageError(f"{name} backend: parity compares step-0 gradients and it declares no gradients "
                             "method (docs/backends.md); compare it by its loss curves with `harness run`")
