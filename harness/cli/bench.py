"""`harness bench`: its options, the overhead benchmark's command and the noise benchmark's.
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.backends import BackendUnavailable, backend_class
from harness.bench import overhead
from harness.bench.noise import Hogs, _harness, _leg_failed, checks, format_result, run_result, sweep_result
from harness.bench.overhead import (
    ISOLATED,
    SCHEMA,
    SCHEMA_VERSION,
    TARGETS,
    Job,
    _count,
    _loadavg,
    _mib,
    bench_environment,
    measure_isolated,
    misses,
)
from harness.cli.options import (
    DEFAULT_OUT,
    add_backend,
    add_data,
    add_quiet,
    add_size,
    out_arg,
    pick_backends,
    pick_sizes,
)
from harness.config.fields import seed_arg
from harness.config.load import load_config
from harness.config.presets import PRESETS, SIZES
from harness.core.data import check_fits, load_corpus
from harness.environment import usable_cores
from harness.errors import UsageError
from harness.run import records
from harness.units import utc_now


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness bench`."""
    add_backend(p, "torch, numpy, flux, or all (every backend that can run here); repeat or comma-separate "
                "(default torch)")
    add_size(p, f"size preset(s): {', '.join(PRESETS)}, or all ({', '.join(SIZES)}); repeat or comma-separate "
             "(default small,medium)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    p.add_argument("--steps", type=_count(1), default=5, metavar="N",
                   help="unlike run: the timed steps of each repeat (5: short rounds pair the two loops closely "
                        "in time)")
    p.add_argument("--warmup", type=_count(0), default=10, metavar="N",
                   help="untimed steps before the first repeat, per loop (10)")
    p.add_argument("--repeats", type=_count(1), default=30, metavar="N",
                   help="rounds of runner, bare, stream; the figures are medians over them (30)")
    add_data(p)
    p.add_argument("--out", type=out_arg, default=DEFAULT_OUT, metavar="DIR",
                   help="output directory; the JSON goes to DIR/bench/ (reports/)")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seed of the weights and batches (1337)")
    p.add_argument("--dtype", choices=("float32", "float64"),
                   help="floating type where the backend supports a choice (torch: float32, numpy: float64)")
    p.add_argument("--compile", action="store_true", help="torch: torch.compile both loops' model")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), help="torch on CUDA: matmul precision (fp32)")
    p.add_argument("--threads", type=_count(1), metavar="N",
                   help="unlike run: torch's intra-op CPU threads in the measuring process (default: torch's own "
                        "choice; numpy's BLAS keeps its own)")
    p.add_argument("--isolate", action="store_true",
                   help="measure every backend and size in a fresh child process (flux always is)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a target is missed (overhead > 3%% on CPU for medium/large, > 5%% on CUDA; "
                        "batch stream < 50x faster than a step)")
    add_quiet(p)
    g = p.add_argument_group("noise benchmark (--noise: does a speed verdict survive other work on the machine?)")
    g.add_argument("--noise", action="store_true",
                   help="instead of the overhead measurements: a sweep and a run of --sizes (one) and --backends "
                        "(two), each quiet and then with busy-loop hogs during its middle third; prints both speed "
                        "ratios, the disturbed cells and the checks of docs/benchmarks.md (--check: exit 1 on a miss)")
    g.add_argument("--hogs", type=_count(1), metavar="N", help="--noise: busy-loop processes (default: usable cores)")
    g.add_argument("--noise-seeds", type=_count(1), default=3, metavar="N", help="--noise: sweep seeds (3)")
    g.add_argument("--noise-steps", type=_count(1), default=200, metavar="N", help="--noise: sweep steps (200)")
    g.add_argument("--noise-run-steps", type=_count(1), default=300, metavar="N",
                   help="--noise: steps of the single-backend run (300)")


def backend_options(args: argparse.Namespace, name: str) -> dict:
    """Constructor options of backend `name` from the command line (dtype; torch: compile, precision)."""
    opts: dict = {}
    if args.dtype:
        opts["dtype"] = args.dtype
    if name == "torch":
        if args.compile:
            opts["compile"] = True
        if args.precision:
            opts["precision"] = args.precision
    return opts


def plan_jobs(args: argparse.Namespace) -> list[Job]:
    """Validate every input (nothing is written on failure) and return the measurements to make."""
    backends = pick_backends(args.backend, default=("torch",), device=args.device)
    sizes = pick_sizes(args.size, default=("small", "medium"))
    if (args.compile or args.precision) and "torch" not in backends:
        raise UsageError("--compile and --precision apply to the torch backend only; add torch to --backend")
    for name in backends:
        cls = backend_class(name)  # importing a backend module imports no framework (flux: juliacall is lazy)
        try:
            cls.check_available(args.device)
            instance = cls(**backend_options(args, name))  # validates dtype / precision without a device
            if hasattr(instance, "check_device"):
                instance.check_device(args.device)  # e.g. --precision bf16 on the CPU or a pre-Ampere GPU
        except BackendUnavailable as exc:
            raise UsageError(str(exc)) from None
    corpus = load_corpus(args.data)
    configs = {size: load_config(size) for size in sizes}
    for config in configs.values():
        check_fits(corpus, config.block_size, config.batch_size)
    records.check_writable(args.out)
    return [Job(backend=name, size=size, config=configs[size].to_dict(), data=corpus.path, device=args.device,
                seed=args.seed, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                options=backend_options(args, name), threads=args.threads, progress=not args.quiet,
                isolated=args.isolate or name in ISOLATED)
            for name in backends for size in sizes]


def format_table(results: list[dict]) -> str:
    """The human-readable summary: one row per backend and size."""
    head = ("backend", "size", "device", "runner ms/step", "p90", "bare ms/step", "p90", "tokens/s", "overhead",
            "harness us/step", "batches/s", "stream x step", "peak memory")
    rows = [head]
    for r in results:
        if r["status"] != "completed":
            rows.append((r["backend"], r["size"], r["device"], r["status"], *[""] * (len(head) - 4)))
            continue
        a, b, s, m = r["runner"], r["bare"], r["stream"], r["memory"]
        rows.append((r["backend"], r["size"], r["device"], f"{a['step_ms_median']:.2f}", f"{a['step_ms_p90']:.2f}",
                     f"{b['step_ms_median']:.2f}", f"{b['step_ms_p90']:.2f}", f"{a['tokens_per_s']:,.0f}",
                     f"{r['overhead_pct']:+.2f}%", f"{r['harness_only']['us_per_step_median']:.0f}",
                     f"{s['batches_per_s']:,.0f}", f"{s['x_step']:,.0f}x",
                     f"{_mib(m.get('peak_bytes'))} {m.get('kind', '')}".strip()))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    """`harness bench`: validate, measure every backend and size, print the table, write the JSON."""
    if getattr(args, "noise", False):
        from harness.cli import bench

        return bench.noise_command(args)
    jobs = plan_jobs(args)
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
    doc = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "started_at": started,
        "finished_at": utc_now(),
        "options": {"backends": backends, "sizes": list(dict.fromkeys(j.size for j in jobs)), "device": args.device,
                    "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
                    "data": jobs[0].data, "threads": args.threads, "isolate": args.isolate, "check": args.check},
        "targets": TARGETS,
        "environment": {**bench_environment(args.device, results), "loadavg_1min_start": load_start,
                        "loadavg_1min_end": _loadavg()},
        "results": results, "misses": missed,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(args.out) / "bench" / f"bench-{stamp}-{secrets.token_hex(3)}.json"
    records.atomic_write_json(path, _jsonable(doc))
    print(format_table(results))
    for r in results:
        cp = r.get("contention_probe")
        if cp:
            print(f"contention evidence, {r['backend']}/{r['size']}: {cp['tick_us']:.2f} us per step + a "
                  f"{cp['snapshot_us']:.0f} us reading of the machine once every {cp['chunk_s']:g} s = "
                  f"{cp['pct_of_step']:.3f}% of a step (reading it at every step would cost "
                  f"{cp['per_step_snapshot_pct']:.1f}%)")
    print(f"overhead: runner / bare - 1, median of {args.repeats} paired rounds of {args.steps} steps, "
          f"{'process CPU time' if args.device == 'cpu' else 'wall time'}; harness us/step: the runner driving a "
          "no-op backend; stream x step: bare step time / batch time")
    for line in missed:
        print(f"target missed: {line}", file=sys.stderr)
    if not missed:
        print("targets: all met", file=sys.stderr)
    print(f"bench: {path}", file=sys.stderr)
    failed = any(r["status"] != "completed" for r in results)
    return 1 if failed or (args.check and missed) else 0


def _jsonable(obj: Any) -> Any:
    """Tuples to lists, NumPy scalars to Python, non-finite floats to None (strict JSON for other tools)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj



def noise_command(args: argparse.Namespace) -> int:
    """`harness bench --noise`: the four legs, the table, the JSON."""
    from harness.cli.options import pick_backends, pick_sizes

    backends = pick_backends(args.backend, default=(), device=args.device)
    sizes = pick_sizes(args.size, default=())
    if len(backends) != 2 or len(sizes) != 1:
        raise UsageError("--noise compares two backends at one size; pass e.g. --backend torch,numpy --size small")
    from harness.config.load import load_config
    from harness.core.data import check_fits, load_corpus

    corpus = load_corpus(args.data)  # bad data is one line before any leg starts (each leg reads it again)
    config = load_config(sizes[0])
    check_fits(corpus, config.block_size, config.batch_size)
    records.check_writable(args.out)
    hogs = args.hogs or usable_cores()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = Path(args.out) / "bench" / f"noise-{stamp}-{secrets.token_hex(3)}"
    common = [*(["--threads", str(args.threads)] if args.threads else []), "--data", corpus.path, "--no-text",
              "--quiet"]
    sweep = ["sweep", "--size", sizes[0], "--backend", ",".join(backends), "--seeds", str(args.noise_seeds),
             "--steps", str(args.noise_steps), *common]
    run = ["run", "--size", sizes[0], "--steps", str(args.noise_run_steps), "--backend", backends[0], *common]
    result: dict[str, Any] = {"options": {"size": sizes[0], "backends": backends, "seeds": args.noise_seeds,
                                          "steps": args.noise_steps, "run_steps": args.noise_run_steps,
                                          "hogs": hogs, "cores": usable_cores(), "threads": args.threads},
                              "started_at": stamp, "dir": str(root)}
    timing: dict[str, Any] = {}
    for kind, argv, reader in (("sweep", sweep, sweep_result), ("run", run, run_result)):
        code, quiet_s = _harness([*argv, "--out", str(root / f"{kind}-quiet")], None, args.quiet)
        if code != 0:
            return _leg_failed(argv, code, root)
        # the sweep: hogs in its middle third (disturbed cells among quiet ones, as on a shared machine); the run (a
        # few seconds, most of it start-up): hogs for the whole invocation, so that its training is disturbed
        h = Hogs(hogs, quiet_s / 3, 2 * quiet_s / 3) if kind == "sweep" else Hogs(hogs, 0.0, None)
        code_d, disturbed_s = _harness([*argv, "--out", str(root / f"{kind}-disturbed")], h, args.quiet)
        if code_d != 0:
            return _leg_failed(argv, code_d, root)
        timing[kind] = {"quiet_s": quiet_s, "disturbed_s": disturbed_s, "hogs_window_s": h.window,
                        "hogs_epochs": h.epochs, "exit_status": [code, code_d]}
        for leg, out in (("quiet", root / f"{kind}-quiet"), ("disturbed", root / f"{kind}-disturbed")):
            try:
                result[f"{kind}_{leg}"] = reader(out, h.epochs if leg == "disturbed" else None)
            except (UsageError, OSError, ValueError) as exc:
                result[f"{kind}_{leg}"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["timing"] = timing
    result["checks"] = checks(result)
    path = root / "noise.json"
    records.atomic_write_json(path, result)
    print(format_result(result))
    print(f"bench: {path}", file=sys.stderr)
    return 1 if args.check and not all(c["ok"] for c in result["checks"]) else 0
