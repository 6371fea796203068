"""The options of `python tools/gpu_check.py`, their checks (bad input: one line on stderr, exit 2, nothing
written), and `main`."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from gpucheck import plan as plans
from gpucheck import runner, schedule, summary
from gpucheck.nanogpt import missing_files

DOC = """The GPU check: everything a GPU has to prove about the harness, in a fixed priority order, within a time
budget, resumable (a second call with the same --out runs what is left), one summary (OUT/summary.md and
OUT/summary.json, rewritten after every check).

    HARNESS_DATA=.../tinyshakespeare.txt python tools/gpu_check.py --out gpu-check --budget 420 \\
        --nanogpt PATH/TO/nanoGPT                        # twice: the second call continues
    python tools/gpu_check.py --plan --budget 420       # the order, the estimates, what fits each call
    python tools/gpu_check.py --dry-run --out /tmp/gc   # the same checks on the CPU, tiny (CI runs it)

Tiers: 1 preflight; 2 a torch,numpy paired run on the GPU that gives a verdict; 3 a 3-seed paired sweep (a green
verdict); 4 bench overhead fp32 and --cuda-graphs at every preset; 5 medium with --cuda-graphs against eager; 6 the
5000-step recipe beside nanoGPT's train.py; 7 the rest. Exit status: 0 no check failed (some may be left for the
next call: the last line says so), 1 a check failed, 2 bad input, 130/143 stopped by SIGINT/SIGTERM (the summary
holds what finished). docs/benchmarks.md, "The GPU check"."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def fail(message: str) -> NoReturn:
    print(f"gpu_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def build_parser() -> Parser:
    ap = Parser(prog="gpu_check.py", description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check", help="where the summary and every check's output go, resolved "
                    "against the directory you run from; nothing is written outside it (default gpu-check)")
    ap.add_argument("--budget", type=_seconds, metavar="SECONDS", help="start no check whose estimate does not fit "
                    "the time left (default: no limit); a check still running at the end is stopped, and runs again "
                    "in the next call")
    ap.add_argument("--plan", action="store_true", help="print the order, the estimates and what fits each call of "
                    "--budget; run nothing, write nothing")
    ap.add_argument("--estimates", type=Path, metavar="FILE", help="plan from the measured times of an earlier "
                    "summary.json (OUT's own summary is read too)")
    ap.add_argument("--dry-run", action="store_true", help="the same checks on the CPU, tiny (what CI runs)")
    ap.add_argument("--only", metavar="NAMES", help="run only these checks (comma-separated: exact names, or "
                    "prefixes such as bench,recipe-300), again even when they have a result")
    ap.add_argument("--skip-long", action="store_true", help="skip the 5000-step runs")
    ap.add_argument("--nanogpt", type=Path, metavar="PATH", help="a checkout of karpathy/nanoGPT to run beside the "
                    "harness (its data is written from --data: no download)")
    ap.add_argument("--data", default=os.environ.get("HARNESS_DATA"),
                    help="Tiny Shakespeare (default $HARNESS_DATA); a dry run without it trains on the harness's "
                         "sample text (`sample`, made offline)")
    ap.add_argument("--jobs", type=int, help="untimed checks (parity, doctor) run this many at once (default: 5 on "
                    "a GPU, 1 in a dry run)")
    ap.add_argument("--recipe-mode", default="eager", metavar="MODE", help="the 5000-step recipe's step: eager, "
                    "compile, cuda-graphs or reduce-overhead, spelled so or as the option (--cuda-graphs)")
    ap.add_argument("--recipe-target", type=_seconds, default=plans.RECIPE_TARGET, metavar="LOSS",
                    help=f"the 5000-step recipe passes at a best validation loss at most this (default "
                         f"{plans.RECIPE_TARGET}, this project's bound; nanoGPT publishes 1.4697)")
    ap.add_argument("--profile", choices=("eager", "cuda-graphs"), help=argparse.SUPPRESS)  # one check's child
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return ap


def join_mode(argv: list[str]) -> list[str]:
    """`--recipe-mode --cuda-graphs` (a value that looks like an option) as `--recipe-mode=--cuda-graphs`."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--recipe-mode" and i + 1 < len(argv):
            out.append(f"--recipe-mode={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def resolve_out(text: str, write: bool = True) -> Path:
    """--out against the caller's directory, absolute; an existing non-directory is refused, and (to `write`) one
    that cannot be created."""
    out = Path(os.path.abspath(os.path.expanduser(text)))
    if out.exists() and not out.is_dir():
        fail(f"--out {text}: {out} exists and is not a directory; give a directory (it is created when missing)")
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if not write:
        return out
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        fail(f"--out {text}: cannot create {out} ({parent} is not a writable directory)")
    return out


def validate(args: argparse.Namespace, argv: list[str]) -> None:
    """Every option checked before anything is written (one line, exit 2 on the first problem)."""
    if args.jobs is not None and args.jobs < 1:
        fail(f"--jobs {args.jobs}: give 1 or more (the untimed checks run this many at once)")
    args.jobs = args.jobs or (1 if args.dry_run else 5)
    mode = plans.normalise_mode(args.recipe_mode)
    if mode is None:
        fail(f"--recipe-mode {args.recipe_mode!r}: give one of {', '.join(plans.RECIPE_MODES)} (or --cuda-graphs, "
             "--compile, --compile reduce-overhead)")
    args.recipe_mode, args.argv = mode, argv
    args.out = resolve_out(args.out, write=not args.plan)
    args.data = data_file(args)
    if not args.plan and (args.data is None or not Path(args.data).is_file()):
        fail("no data file: set HARNESS_DATA or pass --data PATH (Tiny Shakespeare; a dry run may use --data sample)")
    if args.nanogpt is not None:
        args.nanogpt = Path(os.path.abspath(args.nanogpt))
        if missing_files(args.nanogpt):
            fail(f"--nanogpt {args.nanogpt}: no {', '.join(missing_files(args.nanogpt))} there; give a checkout of "
                 "karpathy/nanoGPT")
    args.estimates = estimates(args)


def data_file(args: argparse.Namespace) -> Path | None:
    """--data (or HARNESS_DATA) as an absolute path; `sample`, and nothing at all in a dry run, is the harness's
    sample text (harness.core.sample), said on stderr: a dry run needs no file of one's own and no network."""
    if str(plans.ROOT) not in sys.path:
        sys.path.insert(0, str(plans.ROOT))  # this checkout's harness, as every check runs it
    from harness.core.sample import NAME, sample_path

    if args.data == NAME or (args.data is None and args.dry_run and not args.plan):
        path = sample_path()
        print(f"gpu_check: data: the harness's sample text {path} (a generated play, not Tiny Shakespeare; --data "
              "PATH for another)", file=sys.stderr)
        return path
    return None if args.data is None else Path(os.path.abspath(args.data))


def estimates(args: argparse.Namespace) -> dict[str, float]:
    """Measured times that replace the table's estimates: --estimates FILE's, then OUT's own summary's."""
    times: dict[str, float] = {}
    if args.estimates is not None:
        times.update(summary.measured_times(_read_any(Path(os.path.abspath(args.estimates)))))
    try:
        times.update(summary.measured_times(summary.load(args.out, args.dry_run)))
    except summary.SummaryError as exc:
        fail(str(exc))
    return times


def _read_any(path: Path) -> dict[str, Any]:
    """A summary.json given to --estimates, of either kind of run (times are per check name)."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        fail(f"--estimates {path}: unreadable ({type(exc).__name__}); give a summary.json of an earlier GPU check")
    if not isinstance(doc, dict) or doc.get("schema") != summary.SCHEMA:
        fail(f"--estimates {path}: not a GPU check's summary.json")
    return doc


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(join_mode(raw))
    if args.profile:
        from gpucheck.profile import profile

        return profile(args.profile, args.device, args.dry_run)
    validate(args, raw)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(plans.ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.data is not None:  # what every check trains on, those run in this process too (runner.in_process)
        os.environ["HARNESS_DATA"] = str(args.data)
    checks = plans.plan(args)
    selected, unmatched = plans.select(checks, args.only)
    if unmatched:
        names = ", ".join(c.name for c in checks)
        fail(f"--only {','.join(unmatched)} matches no check; the checks are: {names}")
    if args.plan:
        done = {n: r["result"] for n, r in summary.rows_by_name(_existing(args)).items() if r["result"] in summary.DONE}
        source = "measured (summary)" if args.estimates else "the H100 table" if not args.dry_run else "the dry table"
        print(schedule.plan_text(selected, args.budget, args.jobs, done, source))
        return 0
    explicit = {c.name for c in selected} if args.only else set()
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--out {args.out}: cannot create it ({exc.strerror})")
    return runner.run_all(args, checks, selected, explicit)


def _existing(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        return summary.load(args.out, args.dry_run)
    except summary.SummaryError as exc:
        fail(str(exc))
