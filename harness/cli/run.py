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
    run_ids: list[str] = []
    runs: list[dict] = []
    for plan in plans:
        paths = run_plan.write_spec(plan)
        run_ids.append(paths.run_id)
        where = (plan.device if not plan.devices else
                 ", ".join(f"{b} on {plan.device_of(b)}" for b in backends))
        print(f"run {paths.run_id}: {plan.config.name} on {where}, backends {', '.join(backends)}", file=sys.stderr)
        print(f"  {corpus.summary()}", file=sys.stderr)
        if args.compile and taking("compile", backends):
            where = compile_cache_env().get("TORCHINDUCTOR_CACHE_DIR", "$TORCHINDUCTOR_CACHE_DIR")
            print(f"  torch.compile caches go to {where}", file=sys.stderr)
        codes = supervise.execute(paths, backends, progress=plan.progress, threads=plan.threads,
                                  paired_rounds=plan.paired_rounds)
        code, summary = finish(paths, codes)
        worst = max(worst, code)
        runs.append(summary)
        if 130 in codes.values():
            worst = 130
            break
    report = None if args.no_report else write_reports(args.out, run_ids, quiet_disk_error=worst == 2)
    return said("run", args, worst, runs, report)


def said(command: str, args: argparse.Namespace, code: int, runs: list[dict], report: Path | None) -> int:
    """The result on stdout (docs/usage.md, "Scripting"): each run's id, one a line, or with --json one object
    (the runs, their backends and records, the report); returns `code`. Nothing under Ctrl-C (130)."""
    from harness.cli.options import print_json

    if code == 130:
        return code
    if getattr(args, "json", False):
        print_json(command, code, out=str(args.out), runs=runs, report=report,
                   index=report.parent / "index.html" if report else None)
    else:
        for run in runs:
            print(run["id"], flush=True)
    return code


def say_if_busy(threads: int | None, devices: list[str]) -> None:
    """Print harness.run.processes.busy_machine_line when a backend trains on the CPU of a machine without the idle
    CPUs its threads need (a busy machine once made a first run 100x slower without a word)."""
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


def finish(paths: RunPaths, codes: dict[str, int]) -> tuple[int, dict]:
    """Print where the records are, check the backends saw identical inputs; returns the exit status and the run's
    summary (what --json prints of it)."""
    from harness.store import compare_fingerprints, load_run
    from harness.timing import contention

    spec, recs = load_run(paths)
    summary: dict = {"id": paths.run_id, "dir": str(paths.dir), "label": spec.label, "backends": []}
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
        summary["backends"].append({
            "backend": rec.backend, "status": rec.status_text, "steps": rec.curves.steps_done,
            "val_loss": last.val_loss if last else None, "tokens_per_s": tps, "disturbed": bool(tag),
            "record": str(paths.record(rec.backend))})
    summary["paired_timing"] = summary["speed"] = None
    if paths.paired_timing.exists():
        from harness.timing import paired

        try:
            line = paired.headline(paired.load(paths.paired_timing))
            print(f"  {line} -> {paths.paired_timing}", file=sys.stderr)
            summary.update(paired_timing=str(paths.paired_timing), speed=line.removeprefix("paired timing: "))
        except UsageError as exc:
            print(f"  warning: {exc}", file=sys.stderr)
    problems = compare_fingerprints(recs)
    for problem in problems:
        print(f"  warning: {problem}: the comparison is not fair", file=sys.stderr)
    summary["inputs_identical"] = not problems
    if any(c == 2 for c in codes.values()):
        return 2, summary
    if problems or any(c not in (0, 130) for c in codes.values()):
        return 1, summary
    return (130 if 130 in codes.values() else 0), summary


def write_reports(out: Path, run_ids: list[str], quiet_disk_error: bool = False) -> Path | None:
    """The run report and the index; with `quiet_disk_error` (a worker has already printed the error line of a full
    or unwritable disk) a report that cannot be written is a note, not a second error line. Returns the report's
    path (None: none written)."""
    from harness.report import write_index, write_report
    from harness.store import os_error_message

    if not run_ids:
        return None
    try:
        path = write_report(out, run_ids)
        write_index(out)
    except OSError as exc:
        if not quiet_disk_error:
            raise
        print(f"  no report: {os_error_message(exc, 'it cannot be written either')}", file=sys.stderr)
        return None
    print(f"report: {path}", file=sys.stderr)
    return Path(path)


def resume_run(args: argparse.Namespace, run_id: str) -> int:
    """`harness resume RUN_ID`: continue run `run_id` under --out from its checkpoints, as it was started (its
    spec: `harness resume` takes no option that would change what it computes); --threads and --paired-rounds may
    change."""
    from harness.run import resumable, supervise
    from harness.store import RunPaths, check_writable, load_run

    paths = RunPaths(Path(args.out), run_id)
    spec, _ = load_run(paths, runnable=True)  # the spec and every record checked here, before a worker starts
    # the run is the one its files say (spec digests, records, checkpoints): a refusal is the only line, nothing
    # written; checked again under the run's lock before the first worker starts (harness.run.supervise.execute)
    resumable.check_run(paths, spec, spec.backends)
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
    code, summary = finish(paths, codes)
    report = None if args.no_report else write_reports(args.out, [run_id], quiet_disk_error=code == 2)
    return said("resume", args, code, [summary], report)
