"""`harness run`: plan, train each backend in its own worker, time them side by side, report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.backends import BOTH, DEFAULT_BACKEND
from harness.cli.options import (
    backend_options,
    check_option_targets,
    common_device,
    configure,
    parse_devices,
    pick_backends,
    pick_sizes,
)
from harness.config.load import load_config
from harness.errors import UsageError
from harness.run.processes import compile_cache_env
from harness.store import RunPaths, RunSpec


# --- run ---------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from harness.backends import taking
    from harness.core.data import load_corpus
    from harness.run import plan as run_plan
    from harness.run import supervise
    from harness.store import check_writable

    if args.resume is not None:  # `harness resume RUN_ID`, formerly spelled `harness run --resume RUN_ID`; an
        return resume_run(args, args.resume)  # empty id (an unset shell variable) is refused, never a new run
    args.seed = 1337 if args.seed is None else args.seed
    backends = pick_backends(args.backend, default=(), device=common_device(args.device), repeats=True)
    if args.both:
        backends += [b for b in BOTH if b not in backends]
    backends = list(dict.fromkeys(backends)) or [DEFAULT_BACKEND]  # --backend torch --both: torch once
    device, devices = parse_devices(args.device, backends)
    sizes = pick_sizes(args.size)
    if len(sizes) > 1 and args.config:
        raise UsageError(f"--size {','.join(sizes)} and --config exclude each other; pass one")
    check_option_targets(args, backends)
    check_writable(args.out)
    corpus = load_corpus(args.data, keep_line_endings=args.keep_line_endings)
    plans = [run_plan.Plan(config=configure(args, size), corpus=corpus, backends=backends, device=device,
                           devices=devices if set(devices.values()) != {device} else {},
                         seed=args.seed, out=args.out, backend_options=backend_options(args, backends),
                         checkpoint_every=args.checkpoint_every or 0, text=not args.no_text,
                         progress=not args.quiet, threads=args.threads, allow_large=args.allow_large,
                         paired_rounds=paired_rounds(args))
             for size in sizes]
    for plan in plans:
        run_plan.preflight(plan)
    say_if_busy(args.threads, [plans[0].device_of(b) for b in backends])
    worst = 0
    run_ids = []
    for plan in plans:
        paths = run_plan.write_spec(plan)
        run_ids.append(paths.run_id)
        where = (plan.device if not plan.devices else
                 ", ".join(f"{b} on {plan.device_of(b)}" for b in backends))
        print(f"run {paths.run_id}: {plan.config.name} on {where}, backends {', '.join(backends)}", file=sys.stderr)
        print(f"  {corpus.summary()}", file=sys.stderr)
        if args.compile and taking("compile", backends):
            where = compile_cache_env(paths).get("TORCHINDUCTOR_CACHE_DIR", "$TORCHINDUCTOR_CACHE_DIR")
            print(f"  torch.compile caches go to {where}", file=sys.stderr)
        codes = supervise.execute(paths, backends, progress=plan.progress, threads=plan.threads,
                                  paired_rounds=plan.paired_rounds)
        worst = max(worst, finish(paths, codes))
        if 130 in codes.values():
            worst = 130
            break
    if not args.no_report:
        write_reports(args.out, run_ids, quiet_disk_error=worst == 2)
    return worst


def say_if_busy(threads: int | None, devices: list[str]) -> None:
    """Print harness.run.processes.busy_machine_line when a backend trains on the CPU of a machine without the idle
    CPUs its threads need (issue 29: a busy machine made a first run 100x slower without a word)."""
    from harness.run.processes import busy_machine_line

    line = busy_machine_line(threads) if "cpu" in devices else None
    if line:
        print(line, file=sys.stderr)


def paired_rounds(args: argparse.Namespace, spec: RunSpec | None = None) -> int:
    """--paired-rounds, else the run's stored value (on --resume), else the default."""
    from harness.timing.paired import ROUNDS

    if args.paired_rounds is not None:
        return args.paired_rounds
    stored = spec.paired_rounds if spec is not None else None
    return ROUNDS if stored is None else stored


def finish(paths: RunPaths, codes: dict[str, int]) -> int:
    """Print where the records are, check the backends saw identical inputs; returns the exit status."""
    from harness.store import compare_fingerprints, load_run
    from harness.timing import contention

    _, recs = load_run(paths)
    for rec in recs:
        last = rec.curves.last_eval
        val = f", val loss {last.val_loss:.4f} at step {last.step}" if last else ""
        tps = rec.timings.tokens_per_s
        tag = contention.disturbed_tag(rec.timings.contention)
        speed = f", {tps:,.0f} tokens/s" + (f" ({tag}: the machine was busy, not a speed to rely on)" if tag else
                                             "") if tps else ""
        resumed = rec.resumed_from_step
        since = f", resumed from step {', then '.join(map(str, resumed))}" if resumed else ""
        print(f"  {rec.backend}: {rec.status_text}{val}{speed}{since} -> {paths.record(rec.backend)}",
              file=sys.stderr)
    if paths.paired_timing.exists():
        from harness.timing import paired

        try:
            print(f"  {paired.headline(paired.load(paths.paired_timing))} -> {paths.paired_timing}", file=sys.stderr)
        except UsageError as exc:
            print(f"  warning: {exc}", file=sys.stderr)
    problems = compare_fingerprints(recs)
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
    from harness.report import write_index, write_report
    from harness.store import os_error_message

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
                 "dropout", "scheme", "backend", "both", "checkpoint_every", "compile", "cuda_graphs", "precision",
                 "keep_line_endings", "no_text", "allow_large")


def resume_conflicts(args: argparse.Namespace, spec: RunSpec) -> list[str]:
    """The options given with --resume that differ from what the run was started with (one phrase each)."""
    from harness.backends import taking

    config = spec.config
    opts = {b: o or {} for b, o in spec.backend_options.items()}
    stored_backends = list(spec.backends)
    given = {k: getattr(args, k, None) for k in _RESUME_FIXED}
    problems = []

    def differ(option: str, stored: object) -> None:
        problems.append(f"{option} (the run has {stored})")

    if given["size"] is not None and pick_sizes(given["size"]) != [spec.label]:
        differ("--size", f"config {spec.label!r}")
    if given["config"] is not None or given["set"]:
        from harness.config.nanogpt import apply_overrides, parse_sets

        sets = parse_sets(given["set"])
        mine = load_config(path=given["config"], overrides=sets) if given["config"] else apply_overrides(config, sets)
        if any(v != getattr(config, k) for k, v in mine.to_dict().items() if k != "steps"):
            differ("--config" if given["config"] else "--set", f"config {spec.label!r} as stored in its "
                   "spec.json")
    if given["data"] is not None:
        from harness.core.data import load_corpus

        if load_corpus(given["data"]).sha256 != spec.data.sha256:
            differ("--data", f"{spec.data.path!r}, sha256 {spec.data.sha256[:12]}...")
    if given["device"] is not None:
        stored = {b: spec.device_of(b) for b in stored_backends}
        if parse_devices(given["device"], stored_backends)[1] != stored:
            differ("--device", spec.device if len(set(stored.values())) == 1 else
                   ", ".join(f"{b}={d}" for b, d in stored.items()))
    if given["seed"] is not None and given["seed"] != spec.seed:
        differ("--seed", spec.seed)
    for key in ("steps", "epochs", "eval_interval", "dropout", "scheme"):
        if given[key] is not None and given[key] != getattr(config, key):
            differ(f"--{key.replace('_', '-')} {given[key]}", f"{key} = {getattr(config, key)}")
    # read as a new run reads them: `all` is every backend available on the run's device
    wanted = (pick_backends(given["backend"], default=(), device=spec.device, repeats=True)
              if given["backend"] else []) + (list(BOTH) if given["both"] else [])
    if wanted and set(wanted) != set(stored_backends):
        differ("--backend", ", ".join(stored_backends))
    if given["checkpoint_every"] is not None and given["checkpoint_every"] != spec.checkpoint_every:
        differ("--checkpoint-every", spec.checkpoint_every or "no checkpoints")
    if given["dtype"] is not None and any(o.get("dtype", given["dtype"]) != given["dtype"] for o in opts.values()):
        differ("--dtype", {b: o.get("dtype", "default") for b, o in opts.items()})
    if given["compile"]:
        stored_mode = next((o.get("compile") for o in opts.values() if o.get("compile")), None)
        stored_mode = "default" if stored_mode is True else stored_mode  # a run stored before --compile MODE
        if stored_mode != given["compile"]:
            differ(f"--compile {given['compile']}", f"--compile {stored_mode}" if stored_mode else "no --compile")
    if given["cuda_graphs"] and not any(o.get("cuda_graphs") for o in opts.values()):
        differ("--cuda-graphs", "no --cuda-graphs")
    takers = taking("precision", list(opts))
    if given["precision"] is not None and any(o.get("precision", "fp32") != given["precision"]
                                              for b, o in opts.items() if b in takers):
        differ("--precision", {b: o.get("precision", "fp32") for b, o in opts.items()})
    if given["keep_line_endings"] and spec.data.line_endings != "kept":
        differ("--keep-line-endings", "line endings normalised")
    if given["no_text"] and spec.text:
        differ("--no-text", "text metrics on")
    return problems


def resume_run(args: argparse.Namespace, run_id: str) -> int:
    """`harness resume RUN_ID`: continue run `run_id` under --out from its checkpoints, as it was started (options
    of `harness run` given beside it must match the run's spec); --threads and --paired-rounds may change."""
    from harness.run import supervise
    from harness.store import RunPaths, check_writable, load_run

    paths = RunPaths(Path(args.out), run_id)
    spec, _ = load_run(paths, runnable=True)  # the spec and every record checked here, before a worker starts
    conflicts = resume_conflicts(args, spec)
    if conflicts:
        raise UsageError(f"resuming {run_id} continues the run as it was started, but these options differ: "
                         f"{'; '.join(conflicts)}; drop them, or start a new run")
    check_writable(paths.dir)
    threads = spec.threads
    if args.threads is not None and args.threads != threads:
        print(f"resume: using --threads {args.threads} (the run started with {threads or 'the default'})",
              file=sys.stderr)
        threads = args.threads
    say_if_busy(threads, [spec.device_of(b) for b in spec.backends])
    data = spec.data
    vocab = f", vocabulary of {data.vocab_size} symbols" if data.vocab_size is not None else ""
    print(f"resuming run {run_id}: data {data.path}{vocab}", file=sys.stderr)
    codes = supervise.execute(paths, spec.backends, resume=True, progress=not args.quiet, threads=threads,
                              paired_rounds=paired_rounds(args, spec))
    code = finish(paths, codes)
    if not args.no_report:
        write_reports(args.out, [run_id], quiet_disk_error=code == 2)
    return code
