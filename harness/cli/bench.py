"""`harness bench`: its options, the overhead benchmark's command and the noise benchmark's.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time

from harness.backends import DEFAULT_BACKEND, PARITY_DEFAULT, check_backend, declaration
from harness.bench import overhead
from harness.bench.noise import (
    Hogs,
    _harness,
    _leg_failed,
    checks,
    failed_leg,
    format_result,
    run_result,
    sweep_result,
)
from harness.bench.overhead import (
    TARGETS,
    TIMED_STEPS,
    Job,
    _count,
    _loadavg,
    _mib,
    bench_environment,
    measure_isolated,
    misses,
)
from harness.cli.options import (
    CHECK_HELP,
    SEEDS_HELP,
    STEPS_HELP,
    add_backend,
    add_compile,
    add_data,
    add_device,
    add_dtype,
    add_json,
    add_out,
    add_precision,
    add_quiet,
    add_seed,
    add_size,
    add_threads,
    backend_options,
    check_option_targets,
    common_device,
    exit_statuses,
    parse_devices,
    pick_backends,
    pick_sizes,
    print_json,
    result_stream,
    shared,
)
from harness.config.load import load_config
from harness.core.data import check_fits, load_corpus
from harness.environment import usable_cores
from harness.errors import UsageError
from harness.store import check_writable
from harness.store.bench import LegTiming, NoiseOptions, NoiseRecord, OverheadOptions, OverheadRecord, OverheadResult
from harness.store.paths import BENCH, inside
from harness.units import text_table, utc_now

OVERHEAD_EXIT = {0: "measured (with --check: and every target met)",
                 1: "a measurement failed, or --check and a target was missed (named on stderr)"}
NOISE_EXIT = {0: "every leg ran (with --check: and every check passed)",
              1: "a leg did not complete, or --check and a check failed"}


def add_overhead_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness bench overhead`."""
    add_backend(p, f"default {DEFAULT_BACKEND}")
    add_size(p, "one or more, repeated or comma-separated (default small,medium)")
    add_device(p)
    p.add_argument("--timed-steps", type=_count(1), default=None, metavar="N",
                   help="timed steps of each repeat (on the CPU 5: short rounds pair the two loops closely in time; "
                        "on CUDA 50, the runner's flush interval, so a repeat holds flushes at their real rate)")
    p.add_argument("--warmup", type=_count(0), default=10, metavar="N",
                   help="untimed steps before the first repeat, per loop (10)")
    p.add_argument("--repeats", type=_count(1), default=30, metavar="N",
                   help="rounds of runner, bare, stream; the figures are medians over them (30)")
    add_data(p)
    add_out(p, "default reports/; the JSON goes to DIR/bench/")
    add_seed(p)
    add_dtype(p)
    add_compile(p, "the runner's and the bare loop's")
    add_precision(p, "%(precision_backends)s (default fp32)")
    add_threads(p, "each measurement then runs in a process of its own, so that the cap applies to it (as "
                "--isolate); default: the frameworks' own choice", type=_count(1))
    p.add_argument("--isolate", action="store_true",
                   help="measure every backend and size in a fresh child process (%(own_process_backends)s always are)")
    p.add_argument("--check", action="store_true",
                   help=shared(CHECK_HELP, "a target missed: overhead > 3%% on CPU for medium/large, > 1%% on "
                                           "CUDA, or a batch stream < 50x faster than a step"))
    add_quiet(p)
    add_json(p, "the record's path and each backend's and size's overhead (the table then goes to stderr)")
    exit_statuses(p, OVERHEAD_EXIT)


def add_noise_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness bench noise`."""
    add_backend(p, f"exactly two, e.g. {','.join(PARITY_DEFAULT)}")
    add_size(p, "one, e.g. small", one=True)
    add_data(p)
    add_out(p, "default reports/; the legs and noise.json go to DIR/bench/noise-*/")
    add_threads(p, "passed to every leg; default: the frameworks' own choice", type=_count(1))
    p.add_argument("--hogs", type=_count(1), metavar="N", help="busy-loop processes (default: usable cores)")
    p.add_argument("--seeds", type=_count(1), default=3, metavar="N",
                   help=shared(SEEDS_HELP, "the sweep leg's (3)"))
    p.add_argument("--steps", type=_count(1), default=200, metavar="N",
                   help=shared(STEPS_HELP, "each cell of the sweep leg (200)"))
    p.add_argument("--run-steps", type=_count(1), default=300, metavar="N",
                   help="training steps of the single-backend run leg (300)")
    p.add_argument("--check", action="store_true", help=shared(CHECK_HELP, "a check of docs/benchmarks.md failed"))
    add_quiet(p)
    add_json(p, "the record's path and the checks (the table then goes to stderr)")
    exit_statuses(p, NOISE_EXIT)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommands of `harness bench`: overhead, noise and parts."""
    from harness.cli.options import Parser

    exit_statuses(p, {0: "measured (see each subcommand)", 1: "a measurement or a leg failed, or --check and a "
                      "target or check missed"})
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="overhead|noise|parts", parser_class=Parser)
    o = sub.add_parser("overhead", help="harness overhead, bare-loop speed and batch-stream speed",
                       description="Is the harness part of what it measures? Times the harness's training loop, a "
                       "bare loop doing the same work, the batch stream and the harness driving a no-op backend, "
                       "in alternating rounds.")
    add_overhead_arguments(o)
    o.set_defaults(func=command)
    n = sub.add_parser("noise", help="does a speed verdict survive other work on the machine?",
                       description="A sweep and a run of two backends at one size, each quiet and then with busy-loop "
                       "hogs during its middle third; prints both speed ratios, the disturbed cells and the checks of "
                       "docs/benchmarks.md.")
    add_noise_arguments(n)
    n.set_defaults(func=noise_command)
    from harness.cli.bench_parts import add_parts_arguments
    from harness.cli.bench_parts import command as parts_command

    t = sub.add_parser("parts", help="where the time goes: every part of the step, forward and backward, side by "
                       "side in every backend",
                       description="Times every part of the training step (the activation taps' parts: emb, per "
                       "block ln_1 ... res2, ln_f, logits, loss), forward and backward, the optimizer and the whole "
                       "step, in each backend's own idiom on the same step-0 activations, the backends side by side "
                       "in alternating rounds; prints a table and one diagnosis per pair of backends naming the "
                       "parts that make up most of their difference, and writes a record and its page.")
    add_parts_arguments(t)
    t.set_defaults(func=parts_command)


def plan_jobs(args: argparse.Namespace) -> list[Job]:
    """Validate every input (nothing is written on failure) and return the measurements to make."""
    backends = pick_backends(args.backend, default=(DEFAULT_BACKEND,), device=common_device(args.device))
    _, devices = parse_devices(args.device, backends)
    sizes = pick_sizes(args.size, default=("small", "medium"))
    check_option_targets(args, backends, "bench")
    options = backend_options(args, backends)
    for name in backends:  # what each declares, and its own checks (dtype, precision, the device), no framework
        check_backend(name, devices[name], options[name])
    corpus = load_corpus(args.data)
    configs = {size: load_config(size) for size in sizes}
    for config in configs.values():
        check_fits(corpus, config.block_size, config.batch_size)
    check_writable(args.out)
    # --threads caps the CPU threads of a process through its environment, as for every backend process of `run`:
    # only a fresh process can take it, so each measurement then runs in one
    return [Job(backend=name, size=size, config=configs[size].to_dict(), data=corpus.path, device=devices[name],
                seed=args.seed, steps=args.timed_steps or TIMED_STEPS[devices[name]], warmup=args.warmup,
                repeats=args.repeats, options=options[name], threads=args.threads, progress=not args.quiet,
                isolated=args.isolate or declaration(name).own_process or args.threads is not None)
            for name in backends for size in sizes]


def format_table(results: list[OverheadResult]) -> str:
    """The human-readable summary: one row per backend and size."""
    head = ("backend", "size", "device", "runner ms/step", "p90", "bare ms/step", "p90", "tokens/s", "overhead",
            "harness us/step", "batches/s", "stream x step", "peak memory")
    rows = [head]
    for r in results:
        if r.status != "completed":
            rows.append((r.backend, r.size, r.device, r.status_text, *[""] * (len(head) - 4)))
            continue
        a, b, s, m = r.runner, r.bare, r.stream, r.memory
        rows.append((r.backend, r.size, r.device, f"{a.step_ms_median:.2f}", f"{a.step_ms_p90:.2f}",
                     f"{b.step_ms_median:.2f}", f"{b.step_ms_p90:.2f}", f"{a.tokens_per_s:,.0f}",
                     f"{r.overhead_pct:+.2f}%", f"{r.harness_only.us_per_step_median:.0f}",
                     f"{s.batches_per_s:,.0f}", f"{s.x_step:,.0f}x",
                     f"{_mib(m.peak_bytes if m else None)} {(m.kind if m else None) or ''}".strip()))
    return text_table(head, rows[1:], right=range(3, len(head)))


def command(args: argparse.Namespace) -> int:
    """`harness bench overhead`: validate, measure every backend and size, print the table, write the JSON."""
    jobs = plan_jobs(args)
    devices = {j.backend: j.device for j in jobs}
    used = set(devices.values())
    device = next(iter(used)) if len(used) == 1 else common_device(args.device)
    backends = list(dict.fromkeys(j.backend for j in jobs))
    results = []
    started = utc_now()
    load_start = _loadavg()
    cores = usable_cores()
    if load_start and load_start > cores and not args.quiet:
        print(f"bench: note: load average {load_start:.1f} on {cores} cores; other work will make the timings "
              "noisy (more --repeats help; on CPU so may --threads 1)", file=sys.stderr)
    for job in jobs:
        results.append(measure_isolated(job) if job.isolated else overhead.measure(job))
    missed = misses(results)
    environment = bench_environment(device, results)
    environment.extra.update(loadavg_1min_start=load_start, loadavg_1min_end=_loadavg())
    doc = OverheadRecord(
        started_at=started, finished_at=utc_now(),
        options=OverheadOptions(
            backends=backends, sizes=list(dict.fromkeys(j.size for j in jobs)), device=device,
            steps=jobs[0].steps if len({j.steps for j in jobs}) == 1 else sorted({j.steps for j in jobs}),
            warmup=args.warmup, repeats=args.repeats, seed=args.seed, data=jobs[0].data, threads=args.threads,
            isolate=args.isolate, check=args.check,
            # per backend, only where --device NAME=DEVICE put one elsewhere
            devices=devices if set(devices.values()) != {device} else None),
        targets=TARGETS, environment=environment, results=results, misses=missed)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = inside(args.out, BENCH) / f"bench-{stamp}-{secrets.token_hex(3)}.json"
    doc.dump(path)
    out = result_stream(args)
    print(format_table(results), file=out)
    for r in results:
        cp = r.contention_probe
        if cp:
            print(f"contention evidence, {r.backend}/{r.size}: {cp.tick_us:.2f} us per step + a "
                  f"{cp.snapshot_us:.0f} us reading of the machine once every {cp.chunk_s:g} s = "
                  f"{cp.pct_of_step:.3f}% of a step (reading it at every step would cost "
                  f"{cp.per_step_snapshot_pct:.1f}%)", file=out)
    clock = ("process CPU time" if used == {"cpu"} else "wall time" if "cpu" not in used
             else "process CPU time on the CPU, wall time on CUDA")
    steps = "/".join(str(n) for n in sorted({j.steps for j in jobs}))
    print(f"overhead: runner / bare - 1, median of {args.repeats} paired rounds of {steps} steps, "
          f"{clock}; harness us/step: the runner driving a no-op backend; stream x step: bare step time / batch time",
          file=out)
    for line in missed:
        print(f"target missed: {line}", file=sys.stderr)
    if not missed:
        print("targets: all met", file=sys.stderr)
    print(f"bench: {path}", file=out)
    failed = any(r.status != "completed" for r in results)
    code = 1 if failed or (args.check and missed) else 0
    if args.json:
        print_json("bench overhead", code, record=path, misses=missed, results=[
            {"backend": r.backend, "size": r.size, "device": r.device, "status": r.status_text,
             "overhead_pct": r.overhead_pct, "runner_ms_per_step": r.runner.step_ms_median if r.runner else None,
             "bare_ms_per_step": r.bare.step_ms_median if r.bare else None} for r in results])
    return code


class Legs:
    """The progress of `bench noise`'s four legs on stderr (not with --quiet): "leg 2 of 4: sweep, with 2 hogs; 1:10
    elapsed, about 1:05 for this leg" (a disturbed leg is expected to take about what its quiet leg took)."""

    TOTAL = 4

    def __init__(self, quiet: bool):
        self.quiet, self.n, self.start = quiet, 0, time.monotonic()

    def next(self, what: str, expected_s: float | None = None) -> None:
        from harness.units import fmt_duration

        self.n += 1
        if self.quiet:
            return
        guess = f", about {fmt_duration(expected_s)} for this leg" if expected_s is not None else ""
        print(f"noise: leg {self.n} of {self.TOTAL}: {what}; {fmt_duration(time.monotonic() - self.start)} "
              f"elapsed{guess}", file=sys.stderr, flush=True)


def noise_command(args: argparse.Namespace) -> int:
    """`harness bench noise`: the four legs, the table, the JSON."""
    backends = pick_backends(args.backend, default=())
    sizes = pick_sizes(args.size, default=())
    if len(backends) != 2 or len(sizes) != 1:
        raise UsageError(f"bench noise compares two backends at one size; pass e.g. --backend "
                         f"{','.join(PARITY_DEFAULT)} --size small")
    from harness.config.load import load_config
    from harness.core.data import check_fits, load_corpus

    corpus = load_corpus(args.data)  # bad data is one line before any leg starts (each leg reads it again)
    config = load_config(sizes[0])
    check_fits(corpus, config.block_size, config.batch_size)
    check_writable(args.out)
    hogs = args.hogs or usable_cores()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = inside(args.out, BENCH) / f"noise-{stamp}-{secrets.token_hex(3)}"
    common = [*(["--threads", str(args.threads)] if args.threads else []), "--data", corpus.path, "--no-text",
              "--quiet"]
    sweep = ["sweep", "--size", sizes[0], "--backend", ",".join(backends), "--seeds", str(args.seeds),
             "--steps", str(args.steps), *common]
    run = ["run", "--size", sizes[0], "--steps", str(args.run_steps), "--backend", backends[0], *common]
    result = NoiseRecord(options=NoiseOptions(size=sizes[0], backends=backends, seeds=args.seeds, steps=args.steps,
                                              run_steps=args.run_steps, hogs=hogs, cores=usable_cores(),
                                              threads=args.threads),
                         started_at=stamp, dir=str(root))
    legs = Legs(args.quiet)
    for kind, argv, reader in (("sweep", sweep, sweep_result), ("run", run, run_result)):
        legs.next(f"{kind}, quiet")
        code, quiet_s = _harness([*argv, "--out", str(root / f"{kind}-quiet")], None, args.quiet)
        if code != 0:
            return _leg_failed(argv, code, root)
        # the sweep: hogs in its middle third (disturbed cells among quiet ones, as on a shared machine); the run (a
        # few seconds, most of it start-up): hogs for the whole invocation, so that its training is disturbed
        h = Hogs(hogs, quiet_s / 3, 2 * quiet_s / 3) if kind == "sweep" else Hogs(hogs, 0.0, None)
        legs.next(f"{kind}, with {hogs} hogs", expected_s=quiet_s)
        code_d, disturbed_s = _harness([*argv, "--out", str(root / f"{kind}-disturbed")], h, args.quiet)
        if code_d != 0:
            return _leg_failed(argv, code_d, root)
        result.timing[kind] = LegTiming(quiet_s=quiet_s, disturbed_s=disturbed_s, hogs_window_s=h.window,
                                        hogs_epochs=h.epochs, exit_status=[code, code_d])
        for leg, out in (("quiet", root / f"{kind}-quiet"), ("disturbed", root / f"{kind}-disturbed")):
            try:
                setattr(result, f"{kind}_{leg}", reader(out, h.epochs if leg == "disturbed" else None))
            except (UsageError, OSError, ValueError) as exc:
                setattr(result, f"{kind}_{leg}", failed_leg(kind, f"{type(exc).__name__}: {exc}"))
    result.checks = checks(result)
    path = root / "noise.json"
    result.dump(path)
    out = result_stream(args)
    print(format_result(result), file=out)
    print(f"bench: {path}", file=out)
    code = 1 if args.check and not all(c.ok for c in result.checks) else 0
    if args.json:
        print_json("bench noise", code, record=path, dir=root, checks=[c.to_dict() for c in result.checks])
    return code
