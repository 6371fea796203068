"""`harness`: the command line. Bad input ends with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from harness.config import PRESETS, SIZES
from harness.configure import load_config
from harness.errors import UsageError
from harness.options import (
    DEFAULT_OUT,
    THREADS_HELP,
    Parser,
    add_backend,
    add_common,
    add_paired,
    add_quiet,
    add_schedule,
    backend_options,
    configure,
    out_arg,
    pick_backends,
    pick_sizes,
    positive_int,
)
from harness.processes import compile_cache_env


# --- run ---------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from harness import launch, records
    from harness.data import load_corpus

    if args.resume is not None:  # an empty id (an unset shell variable) is refused, never a new run
        return resume_run(args)
    args.seed = 1337 if args.seed is None else args.seed
    args.device = args.device or "cpu"
    backends = pick_backends(args.backend, default=(), device=args.device, repeats=True)
    if args.both:
        backends += [b for b in ("torch", "flux") if b not in backends]
    backends = list(dict.fromkeys(backends)) or ["torch"]  # --backend torch --both: torch once
    sizes = pick_sizes(args.size)
    if len(sizes) > 1 and args.config:
        raise UsageError(f"--size {','.join(sizes)} and --config exclude each other; pass one")
    check_option_targets(args, backends)
    records.check_writable(args.out)
    corpus = load_corpus(args.data, keep_line_endings=args.keep_line_endings)
    plans = [launch.Plan(config=configure(args, size), corpus=corpus, backends=backends, device=args.device,
                         seed=args.seed, out=args.out, backend_options=backend_options(args, backends),
                         checkpoint_every=args.checkpoint_every or 0, text=not args.no_text,
                         progress=not args.quiet, threads=args.threads, allow_large=args.allow_large,
                         paired_rounds=paired_rounds(args))
             for size in sizes]
    for plan in plans:
        launch.preflight(plan)
    worst = 0
    run_ids = []
    for plan in plans:
        run_id = launch.write_spec(plan)
        run_ids.append(run_id)
        directory = records.run_dir(plan.out, run_id)
        print(f"run {run_id}: {plan.config.name} on {plan.device}, backends {', '.join(backends)}", file=sys.stderr)
        print(f"  {corpus.summary()}", file=sys.stderr)
        if args.compile and "torch" in backends:
            where = compile_cache_env(directory).get("TORCHINDUCTOR_CACHE_DIR", "$TORCHINDUCTOR_CACHE_DIR")
            print(f"  torch.compile caches go to {where}", file=sys.stderr)
        codes = launch.execute(directory, backends, progress=plan.progress, threads=plan.threads,
                               paired_rounds=plan.paired_rounds)
        worst = max(worst, finish(plan.out, run_id, codes))
        if 130 in codes.values():
            worst = 130
            break
    if not args.no_report:
        write_reports(args.out, run_ids, quiet_disk_error=worst == 2)
    return worst


def paired_rounds(args: argparse.Namespace, spec: dict | None = None) -> int:
    """--paired-rounds, else the run's stored value (on --resume), else the default."""
    from harness.paired import ROUNDS

    if args.paired_rounds is not None:
        return args.paired_rounds
    stored = (spec or {}).get("paired_rounds")
    return ROUNDS if stored is None else stored


def check_option_targets(args: argparse.Namespace, backends: list[str]) -> None:
    """Options that apply to some backends only must apply to one of this run's backends, not be ignored."""
    if args.compile and "torch" not in backends:
        raise UsageError(f"--compile applies to the torch backend only, and this run has {', '.join(backends)}; "
                         "drop --compile or add --backend torch")
    if args.precision and not {"torch", "flux"} & set(backends):
        raise UsageError(f"--precision applies to torch and flux only, and this run has {', '.join(backends)}; "
                         "drop --precision")


def finish(out: Path, run_id: str, codes: dict[str, int]) -> int:
    """Print where the records are, check the backends saw identical inputs; returns the exit status."""
    from harness import launch, records

    _, recs = records.load_run(out, run_id)
    directory = records.run_dir(out, run_id)
    for rec in recs:
        last = rec["evals"][-1] if rec["evals"] else None
        val = f", val loss {last['val_loss']:.4f} at step {last['step']}" if last else ""
        tps = rec["timings"].get("tokens_per_s")
        speed = f", {tps:,.0f} tokens/s" if tps else ""
        resumed = rec.get("resumed_from_step")
        since = f", resumed from step {', then '.join(map(str, resumed))}" if resumed else ""
        print(f"  {rec['backend']}: {rec['status']}{val}{speed}{since} -> {directory / (rec['backend'] + '.json')}",
              file=sys.stderr)
    paired_path = records.RunPaths(Path(out), run_id).paired_timing
    if paired_path.exists():
        from harness import paired

        try:
            print(f"  {paired.headline(paired.load(paired_path))} -> {paired_path}", file=sys.stderr)
        except UsageError as exc:
            print(f"  warning: {exc}", file=sys.stderr)
    problems = launch.compare_fingerprints(recs)
    for problem in problems:
        print(f"  warning: {problem}: the comparison is not fair", file=sys.stderr)
    if any(c == 2 for c in codes.values()):
        return 2
    if problems or any(c not in (0, 130) for c in codes.values()):
        return 1
    return 130 if 130 in codes.values() else 0


def write_reports(out: Path, run_ids: list[str], quiet_disk_error: bool = False) -> None:
    """The run report and the index; with `quiet_disk_error` (a worker has already printed the error line of a full
    or unwritable disk) a report that cannot be written is a note, not a second error line."""
    from harness.records import os_error_message
    from harness.report import write_index, write_report

    if not run_ids:
        return
    try:
        path = write_report(out, run_ids)
        write_index(out)
    except OSError as exc:
        if not quiet_disk_error:
            raise
        print(f"  no report: {os_error_message(exc, 'it cannot be written either')}", file=sys.stderr)
        return
    print(f"report: {path}", file=sys.stderr)


# options of `harness run` that define what a run computes: on --resume they must match the stored spec
_RESUME_FIXED = ("size", "config", "set", "data", "device", "seed", "dtype", "steps", "epochs", "eval_interval",
                 "dropout", "scheme", "backend", "both", "checkpoint_every", "compile", "precision",
                 "keep_line_endings", "no_text", "allow_large")


def resume_conflicts(args: argparse.Namespace, spec: dict) -> list[str]:
    """The options given with --resume that differ from what the run was started with (one phrase each)."""
    config = spec["config"]
    opts = {b: o or {} for b, o in spec["backend_options"].items()}
    stored_backends = list(spec["backends"])
    given = {k: getattr(args, k, None) for k in _RESUME_FIXED}
    problems = []

    def differ(option: str, stored: object) -> None:
        problems.append(f"{option} (the run has {stored})")

    if given["size"] is not None and pick_sizes(given["size"]) != [spec.get("label")]:
        differ("--size", f"config {spec.get('label')!r}")
    if given["config"] is not None or given["set"]:
        from harness.config import config_from_dict
        from harness.nanogpt import apply_overrides, parse_sets

        stored = config_from_dict(config, "spec.json")  # a spec from before the options holds their defaults
        sets = parse_sets(given["set"])
        mine = load_config(path=given["config"], overrides=sets) if given["config"] else apply_overrides(stored, sets)
        if any(v != getattr(stored, k) for k, v in mine.to_dict().items() if k != "steps"):
            differ("--config" if given["config"] else "--set", f"config {spec.get('label')!r} as stored in its "
                   "spec.json")
    if given["data"] is not None:
        from harness.data import load_corpus

        if load_corpus(given["data"]).sha256 != spec["data"]["sha256"]:
            differ("--data", f"{spec['data']['path']!r}, sha256 {spec['data']['sha256'][:12]}...")
    for option, key in (("--device", "device"), ("--seed", "seed")):
        if given[key] is not None and given[key] != spec[key]:
            differ(option, spec[key])
    for key in ("steps", "epochs", "eval_interval", "dropout", "scheme"):
        if given[key] is not None and given[key] != config.get(key):
            differ(f"--{key.replace('_', '-')} {given[key]}", f"{key} = {config.get(key)}")
    # read as a new run reads them: `all` is every backend available on the run's device
    wanted = (pick_backends(given["backend"], default=(), device=spec.get("device", "cpu"), repeats=True)
              if given["backend"] else []) + (["torch", "flux"] if given["both"] else [])
    if wanted and set(wanted) != set(stored_backends):
        differ("--backend", ", ".join(stored_backends))
    if given["checkpoint_every"] is not None and given["checkpoint_every"] != spec.get("checkpoint_every"):
        differ("--checkpoint-every", spec.get("checkpoint_every") or "no checkpoints")
    if given["dtype"] is not None and any(o.get("dtype", given["dtype"]) != given["dtype"] for o in opts.values()):
        differ("--dtype", {b: o.get("dtype", "default") for b, o in opts.items()})
    if given["compile"] and not any(o.get("compile") for o in opts.values()):
        differ("--compile", "no --compile")
    if given["precision"] is not None and any(o.get("precision", "fp32") != given["precision"]
                                              for b, o in opts.items() if b in ("torch", "flux")):
        differ("--precision", {b: o.get("precision", "fp32") for b, o in opts.items()})
    if given["keep_line_endings"] and spec["data"].get("line_endings", "normalised") != "kept":
        differ("--keep-line-endings", "line endings normalised")
    if given["no_text"] and spec.get("text", True):
        differ("--no-text", "text metrics on")
    return problems


def resume_run(args: argparse.Namespace) -> int:
    from harness import launch, records

    spec = launch.load_spec(args.out, args.resume)
    records.load_run(args.out, args.resume)  # every stored record is checked here, before a worker starts
    directory = records.run_dir(args.out, args.resume)
    conflicts = resume_conflicts(args, spec)
    if conflicts:
        raise UsageError(f"--resume {args.resume} continues the run as it was started, but these options differ: "
                         f"{'; '.join(conflicts)}; drop them, or start a new run")
    records.check_writable(directory)
    threads = spec.get("threads")
    if args.threads is not None and args.threads != threads:
        print(f"resume: using --threads {args.threads} (the run started with {threads or 'the default'})",
              file=sys.stderr)
        threads = args.threads
    data = spec["data"]
    vocab = f", vocabulary of {data['vocab_size']} symbols" if "vocab_size" in data else ""
    print(f"resuming run {args.resume}: data {data['path']}{vocab}", file=sys.stderr)
    codes = launch.execute(directory, spec["backends"], resume=True, progress=not args.quiet, threads=threads,
                           paired_rounds=paired_rounds(args, spec))
    code = finish(args.out, args.resume, codes)
    if not args.no_report:
        write_reports(args.out, [args.resume], quiet_disk_error=code == 2)
    return code


# --- sizes -------------------------------------------------------------------------------------------------------
def cmd_sizes(args: argparse.Namespace) -> int:
    from harness.config import preset_path

    if args.toml:
        sys.stdout.write(preset_path(args.toml).read_text(encoding="utf-8"))
        return 0
    import pandas as pd

    rows = {}
    yes = {True: "yes", False: "no"}
    for size in PRESETS:
        c = load_config(size)
        rows[size] = {"embedding d": c.n_embd, "block size n": c.block_size, "batch size": c.batch_size,
                      "layers": c.n_layer, "heads": c.n_head, "MLP hidden d_h": c.d_hidden, "dropout": c.dropout,
                      "tied embeddings": yes[c.tie_embeddings], "GELU": c.gelu, "biases": yes[c.bias],
                      "lm_head bias": yes[c.lm_head_bias], "learning rate": c.learning_rate,
                      "lr schedule": c.lr_schedule if c.lr_schedule == "constant" else f"cosine to {c.min_lr:g}",
                      "warm-up steps": c.warmup_steps, "decay steps": c.decay_steps or "-",
                      "training": f"{c.epochs} epochs" if c.steps is None else f"{c.steps} steps",
                      "batches": c.scheme, "beta2": c.beta2, "weight decay": c.weight_decay,
                      "decay convention": c.decay, "grad clip": c.grad_clip, "eval every": c.eval_interval}
    table = pd.DataFrame({size: {k: v if isinstance(v, str) else f"{v:g}" for k, v in row.items()}
                          for size, row in rows.items()})
    print(table.to_string())
    print("\n`harness sizes --toml NAME` prints a preset's file; nanoGPT's recipes: docs/nanogpt.md")
    return 0


# --- report ------------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from harness import records
    from harness.report import write_index, write_report

    for run_id in args.run_ids:
        records.check_run_id(run_id)
    records.check_writable(args.out)
    for run_id in args.run_ids:
        records.load_run(args.out, run_id)  # a missing or corrupt record fails here, before anything is written
    path = write_report(args.out, args.run_ids)
    write_index(args.out)
    print(f"report: {path}")
    return 0


# --- doctor / setup ----------------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.doctor import doctor

    return doctor()


def cmd_setup(args: argparse.Namespace) -> int:
    from harness.doctor import setup_julia

    return setup_julia(force=args.force)


def write_sweep_report(out: Path, sweep_id: str) -> Path:
    """A sweep's HTML report and the index of `out` (handed to `harness sweep`, which sits below the reports)."""
    from harness.report import write_index
    from harness.report.sweep import write_sweep_report as write

    path = write(out, sweep_id)
    write_index(out)
    return path


def build_parser() -> Parser:
    parser = Parser(prog="harness", description="Train the same nanoGPT in PyTorch, NumPy and Flux.jl, "
                    "with identical data and weights, and compare them.")
    from harness import __version__

    parser.add_argument("--version", action="version", version=f"nanogpt-parity {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("run", help="train one or more backends and write records and a report")
    add_common(p, f"size preset(s): {', '.join(PRESETS)}, or all ({', '.join(SIZES)}; one run each); repeat or "
               "comma-separate (default small)")
    add_schedule(p)
    add_backend(p, "torch, numpy, flux, or all (every backend that can run here); repeat or comma-separate, "
                "e.g. --backend torch,numpy (default torch)")
    p.add_argument("--both", action="store_true", help="same as --backend torch,flux (flux needs Julia: "
                   "`harness setup julia`)")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N", help="save model+optimizer every N steps")
    p.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted run from its checkpoints")
    p.add_argument("--compile", action="store_true", help="torch: torch.compile the model (compiled before step "
                   "0, recorded as compile_s)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), help="torch on a CUDA GPU of compute capability "
                   "8.0+: matmul precision (fp32)")
    p.add_argument("--threads", type=positive_int, metavar="N", help=f"{THREADS_HELP}; default: the frameworks' "
                   "own choice")
    p.add_argument("--no-text", action="store_true", help="skip generation, BLEU and chrF")
    add_paired(p, None)
    p.add_argument("--no-report", action="store_true", help="write records only, no HTML report")
    add_quiet(p)
    p.add_argument("--allow-large", action="store_true", help="train even when the memory estimate exceeds the "
                   "machine's available memory")
    p.add_argument("--keep-line-endings", action="store_true", help="keep CRLF/CR in the text as symbols (default: "
                   "turn them into LF)")
    # None = not given: --resume refuses options that differ from the stored run (defaults applied in cmd_run)
    p.set_defaults(func=cmd_run, size=None, seed=None, device=None)

    p = sub.add_parser("sizes", help="print the size presets")
    p.add_argument("--toml", choices=PRESETS, metavar="SIZE", help=f"print that preset's TOML file instead "
                   f"({', '.join(PRESETS)})")
    p.set_defaults(func=cmd_sizes)

    p = sub.add_parser("report", help="rebuild an HTML report from stored run records")
    p.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="one or more run ids (the folder names under "
                   "DIR/runs/); several make one comparison report")
    p.add_argument("--out", type=out_arg, default=DEFAULT_OUT, metavar="DIR", help="output directory (reports/)")
    p.set_defaults(func=cmd_report)

    from harness import bench, parity

    p = sub.add_parser("parity", help="check that two backends compute the same thing, depth by depth")
    add_common(p, f"the size preset: one of {', '.join(PRESETS)} (default small; parity checks one size at a time)",
               per_backend_device=True, one_size=True)
    parity.add_arguments(p)
    p.set_defaults(func=parity.command)

    p = sub.add_parser("bench", help="measure harness overhead, bare-loop speed and batch-stream speed")
    bench.add_arguments(p)
    p.set_defaults(func=bench.command)

    from harness import sweep

    p = sub.add_parser("sweep", help="many runs over sizes, backends, seeds and fields, locally or on SLURM")
    sweep.add_arguments(p)
    p.set_defaults(func=sweep.command, write_report=write_sweep_report)

    from harness import kit

    p = sub.add_parser("kit", help="a conformance kit for any nanoGPT port: export inputs and the oracle's answers, "
                       "check a port's results")
    kit.add_arguments(p)
    p.set_defaults(func=kit.command)

    p = sub.add_parser("doctor", help="report what is installed (Python, torch, CUDA, Julia, Flux) and what to do")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("setup", help="install and precompile optional parts ahead of time")
    p.add_argument("what", choices=("julia",), help="julia: the Flux.jl environment")
    p.add_argument("--force", action="store_true", help="re-resolve and re-precompile even if it looks done")
    p.set_defaults(func=cmd_setup)
    return parser


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # like Ctrl-C: finish cleanly with exit status 130
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `harness sizes | head`: the reader has gone; nothing to say, and nothing more to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE
    except OSError as exc:  # the file system said no (full disk, read-only, a name too long, ...): not a bug
        from harness.records import os_error_message

        print(f"harness: error: {os_error_message(exc, 'cannot write')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
