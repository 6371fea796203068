"""`harness parity`: its options, and the command that runs both workers and compares them.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from harness.cli.options import THREADS_HELP, add_backend, add_quiet, configure, pick_sizes
from harness.errors import UsageError
from harness.parity import diagnose
from harness.parity.compare import (
    DEFAULT_OPT_STEPS,
    DEFAULT_STEPS,
    EXIT_CRASH,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_USAGE,
    FALLBACK_DTYPES,
    PROBE_BUDGET,
    SCHEMA,
    SCHEMA_VERSION,
    TOL_KEYS,
    Tolerances,
    compare,
    default_tolerances,
    format_gradients,
    format_optimizer,
    format_table,
    precision_pair,
    reference_backend,
)

DEFAULT_BACKENDS = "torch,numpy"


EXIT_STATUSES = f"""exit status:
  {EXIT_PASS}    pass: every check within its tolerance
  {EXIT_FAIL}    FAIL: both backends ran and differ beyond a tolerance (the table and the FAIL lines say where)
  {EXIT_USAGE}    bad input: one line on stderr, nothing run (or a backend refused its input)
  {EXIT_CRASH}    a backend crashed or left no result: nothing was compared (parity.json: verdict "error")
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C or SIGTERM)"""


def _float(text: str) -> float:
    # parsed loosely here, validated in `command` (a UsageError: one line, exit 2, nothing written)
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `harness parity` (the common --size/--config/--data/--device/--seed/--out/--dtype are added
    by the CLI), and the exit statuses in its --help."""
    p.epilog = EXIT_STATUSES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_backend(p, f"the two backends to compare (torch, numpy, jax, flux), in the order the report names them: "
                f"--backend torch --backend numpy or --backend torch,numpy ({DEFAULT_BACKENDS})")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"training steps, all of whose losses are compared ({DEFAULT_STEPS})")
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
                   help="dropout probability; with P > 0 the harness draws every mask and hands the same masks to "
                        "both backends (0)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help=f"{THREADS_HELP}; default 1, unlike run and sweep: one thread fixes every reduction's "
                        "order, so a rerun gives bit-identical numbers (parity times nothing)")
    p.add_argument("--per-parameter", action="store_true",
                   help="also print every parameter's gradient and optimizer-step error")
    add_quiet(p)


def parse_backends(values: str | list[str] | None) -> list[str]:
    """The two backend names of --backend (repeated or comma-separated; default torch,numpy); UsageError for
    anything else."""
    from harness.cli.options import pick_backends

    names = pick_backends(values if values else DEFAULT_BACKENDS, repeats=True)
    text = ",".join(names)
    if len(names) != 2:
        raise UsageError(f"--backend {text}: parity compares exactly two backends, got {len(names)}; "
                         "pass two, e.g. --backend torch --backend numpy")
    if names[0] == names[1]:
        raise UsageError(f"--backend {text}: the same backend twice; compare two different backends "
                         "(use --dtype to vary precision)")
    return names


def backend_dtype(name: str, requested: str | None) -> tuple[str, dict]:
    """The dtype backend `name` will compute in and the options that ask for it.

    --dtype applies to every backend whose constructor takes a dtype; the others keep their own default.
    """
    from harness.backends import backend_class

    default = FALLBACK_DTYPES.get(name, "float32")
    try:
        params = inspect.signature(backend_class(name).__init__).parameters
    except Exception:  # an unavailable backend: preflight reports it
        return (requested or default), ({"dtype": requested} if requested else {})
    if "dtype" not in params:
        return default, {}
    own = params["dtype"].default
    own = own if isinstance(own, str) else default
    return (requested, {"dtype": requested}) if requested else (own, {})


def resolve_tolerances(args: argparse.Namespace, pair: str) -> tuple[Tolerances, dict[str, str]]:
    """Command-line tolerances over the measured defaults of `pair` and the size preset (none for --config, nor
    for a preset changed by --set: the preset's were measured on its own model and schedule); also says where each
    came from."""
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


def _load_probe(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _final_val(rec: dict) -> float | None:
    evals = rec.get("evals") or []
    return float(evals[-1]["val_loss"]) if evals else None


def command(args: argparse.Namespace) -> int:
    """`harness parity`: run two backends in parity mode, compare, write parity.json; the exit status is one of
    `EXIT_STATUSES` (0 pass, 1 numerical FAIL, 2 bad input, 3 a backend crashed, 130 interrupted)."""
    from harness.cli.options import parse_devices
    from harness.cli.parity import parity_options
    from harness.core.data import load_corpus
    from harness.run import plan as run_plan
    from harness.run import records, supervise

    # --- validate everything before anything is written ---
    backends = parse_backends(args.backend)
    args.size = pick_sizes(args.size, one=True)[0]
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
    dtypes, options = {}, {}
    for name in backends:
        dtypes[name], options[name] = backend_dtype(name, args.dtype)
        options[name].update(parity_options(name))  # torch: single-tensor AdamW, math attention on CUDA
    device, devices = parse_devices(args.device, backends)  # --device DEVICE or NAME=DEVICE (repeatable)
    pair = precision_pair(*(dtypes[n] for n in backends))
    tolerances, tol_source = resolve_tolerances(args, pair)
    config = configure(args, args.size, changes={"dropout": dropout, "steps": args.steps})
    corpus = load_corpus(args.data)
    progress = not getattr(args, "quiet", False)
    reference = reference_backend(backends)
    budgeted = opt_k is None
    opt_k = min(args.steps, opt_k if opt_k is not None else max(1, PROBE_BUDGET // run_plan.probe_bytes(
        config, corpus.vocab_size, 1)))
    plan = run_plan.Plan(config=config, corpus=corpus, backends=backends, device=device, seed=args.seed,
                       out=args.out, backend_options=options, text=False,
                       parity={"opt_steps": opt_k, "reference": reference},
                       progress=progress, threads=threads, devices=devices)
    try:
        run_plan.preflight(plan)
    except ImportError as exc:  # a registered backend whose module or framework is not installed
        raise UsageError(f"a backend cannot be loaded ({exc}); see `harness doctor`") from None

    # --- run ---
    run_id = run_plan.write_spec(plan)
    directory = records.run_dir(plan.out, run_id)
    drop = f"dropout {dropout:g} (shared masks)" if dropout else "dropout 0"
    other = next(n for n in backends if n != reference)
    sync = (f"optimizer steps 1..{opt_k} re-synchronised: {other} takes each from {reference}'s state"
            + (f" (the first {opt_k} of {args.steps}: the probe's memory budget; --opt-steps K for more)"
               if budgeted and opt_k < args.steps else "") if opt_k else "optimizer steps not compared")
    print(f"parity {run_id}: {config.name}, {args.steps} steps, {drop}, {backends[0]} ({dtypes[backends[0]]}) "
          f"vs {backends[1]} ({dtypes[backends[1]]}) on {' / '.join(devices[n] for n in backends)}; {sync}",
          file=sys.stderr)
    # the reference first: the other backend reads its states from the reference's probe
    codes = supervise.execute(directory, [reference, other], progress=progress, threads=threads, chained=True)
    record: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": run_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config.to_dict(), "config_name": config.name, "steps": args.steps, "seed": args.seed,
        "dropout": dropout, "opt_steps": opt_k, "opt_reference": reference, "threads": threads,
        "device": device, "devices": devices, "backends": backends, "dtypes": dtypes, "precision_pair": pair,
        "tolerances": asdict(tolerances), "tolerance_source": tol_source,
        "data": {"path": corpus.path, "sha256": corpus.sha256}, "worker_exit_codes": codes,
        "files": {n: {"record": f"{n}.json", "probe": f"{n}.probe.npz"} for n in backends},
    }
    path = directory / "parity.json"
    broken = {n: c for n, c in codes.items() if c != 0}
    if broken or len(codes) != len(backends):
        reason = ", ".join(f"{n} exited {c}" for n, c in broken.items())
        reason += "".join(f", {n} not started (it needs {reference}'s results)" for n in backends if n not in codes)
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared (see the messages above)", file=sys.stderr)
        print(f"parity record: {path}")
        return (EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes.values() else EXIT_USAGE if EXIT_USAGE in codes.values()
                else EXIT_CRASH)

    # --- compare ---
    _, recs = records.load_run(plan.out, run_id)
    by_name = {rec["backend"]: rec for rec in recs}
    ra, rb = by_name[backends[0]], by_name[backends[1]]
    for name, rec in ((backends[0], ra), (backends[1], rb)):
        actual = (rec.get("backend_info") or {}).get("dtype")
        if isinstance(actual, str) and actual != dtypes[name]:
            dtypes[name] = actual  # what the backend says it computed in wins
    if precision_pair(*(dtypes[n] for n in backends)) != pair:
        pair = precision_pair(*(dtypes[n] for n in backends))
        tolerances, tol_source = resolve_tolerances(args, pair)
        record.update(precision_pair=pair, tolerances=asdict(tolerances), tolerance_source=tol_source)
    missing = [n for n in backends if not (directory / f"{n}.probe.npz").is_file()]
    if missing:
        reason = f"no step-0 probe from {', '.join(missing)}"
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared", file=sys.stderr)
        print(f"parity record: {path}")
        return EXIT_CRASH
    va, vb = _final_val(ra), _final_val(rb)
    result = compare(_load_probe(directory / f"{backends[0]}.probe.npz"),
                     _load_probe(directory / f"{backends[1]}.probe.npz"),
                     ra["steps"]["loss"], rb["steps"]["loss"], tolerances,
                     val_losses=(va, vb) if va is not None and vb is not None else None,
                     backends=(backends[0], backends[1]), config=config)
    for problem in records.compare_fingerprints([ra, rb]):
        result.failures.append(f"FAIL: {problem}")
    record.update(verdict="pass" if result.passed else "fail", failures=list(result.failures),
                  results=result.to_dict(), checks=result.rows(), dtypes=dtypes, blind_spots=dict(diagnose.BLIND_SPOTS),
                  backend_info={n: by_name[n].get("backend_info", {}) for n in backends})
    records.atomic_write_json(path, record)

    print(format_table(result))
    if getattr(args, "per_parameter", False):
        print()
        print(format_gradients(result))
        if result.opt_rel_err:
            print()
            print(format_optimizer(result))
    for line in result.failures:
        print(line)
    for line in result.notes:
        print(line)
    if result.passed:
        print(f"PASS: {backends[0]} ({dtypes[backends[0]]}) and {backends[1]} ({dtypes[backends[1]]}) agree "
              f"within tolerance over {result.loss_steps} steps")
    print(f"parity record: {path}")
    return EXIT_PASS if result.passed else EXIT_FAIL


def parity_options(name: str) -> dict:
    """Constructor options backend `name` takes in parity mode (its class's PARITY_OPTIONS; torch: the
    single-tensor AdamW and, on CUDA, the math attention kernel)."""
    from harness.backends import backend_class

    try:
        cls = backend_class(name)
    except Exception:  # an unavailable backend: preflight reports it
        return {}
    return dict(getattr(cls, "PARITY_OPTIONS", {}))
