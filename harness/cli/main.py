"""`harness`: the command line. Bad input ends with one line on stderr and exit status 2, never a traceback.

One grammar (docs/usage.md): `harness VERB [ID...] [--option ...]`; the verbs that act on something stored take its
id (`status`, `report`, `resume`: a run id or a sweep id; `report` also a `bench parts` record's id); `bench` has
the subcommands `overhead`, `noise` and `parts`, `kit` `export` and `check`, `setup` `julia`. Every option of every
command is in its --help: there are no hidden spellings.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from harness.backends import BOTH, DEFAULT_BACKEND
from harness.cli.doctor import cmd_doctor, cmd_setup
from harness.cli.options import (
    ALLOW_LARGE_HELP,
    CHECKPOINT_HELP,
    DROPOUT_HELP,
    JOBS_HELP,
    NO_REPORT_HELP,
    NO_TEXT_HELP,
    NO_WAIT_HELP,
    Parser,
    add_backend,
    add_common,
    add_compile,
    add_json,
    add_out,
    add_paired,
    add_precision,
    add_quiet,
    add_schedule,
    add_threads,
    exit_statuses,
    positive_int,
    shared,
)
from harness.cli.report import cmd_report, write_sweep_report
from harness.cli.resume import cmd_resume
from harness.cli.run import cmd_run
from harness.cli.sizes import cmd_sizes
from harness.cli.status import LAST, cmd_status
from harness.config.presets import PRESETS
from harness.errors import UsageError

RUN_EXIT = {0: "every backend completed, with identical inputs",
            1: "a backend failed, or the backends' inputs differ (the comparison is not fair)",
            2: "bad input (one line on stderr, nothing written), or a worker refused its input or the disk filled up"}
SETUP_EXIT = {0: "installed, precompiled and smoke-tested", 2: "it cannot be installed here (no juliacall, Julia or "
              "network: one line says what and how to fix it)"}
HARNESS_EXIT = {0: "done: passed, completed, measured or printed",
                1: "the command ran and found a failure: a parity FAIL, a failed backend or cell, a missed target",
                3: "parity: a backend crashed, nothing was compared"}


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train one or more backends and write records and a report",
                       description="Train one or more backends, each in its own worker process, on identical batches "
                       "from identical weights; time them side by side; write records and a report.")
    add_backend(p, f"default {DEFAULT_BACKEND}")
    p.add_argument("--both", action="store_true", help=f"same as --backend {','.join(BOTH)}%(both_needs)s")
    add_common(p, "one or more, repeated or comma-separated: one run each (default small)")
    add_schedule(p)
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N", help=CHECKPOINT_HELP)
    add_compile(p)
    add_precision(p, "%(precision_backends)s (default fp32)")
    add_threads(p)
    p.add_argument("--no-text", action="store_true", help=NO_TEXT_HELP)
    add_paired(p, None)
    p.add_argument("--no-report", action="store_true", help=NO_REPORT_HELP)
    add_quiet(p)
    add_json(p, "the runs, their backends and records, the report (without it stdout holds each run's id)")
    p.add_argument("--allow-large", action="store_true", help=ALLOW_LARGE_HELP)
    p.add_argument("--keep-line-endings", action="store_true", help="keep CRLF/CR in the text as symbols (default: "
                   "turn them into LF)")
    p.add_argument("--dropout", type=float, metavar="P", help=shared(DROPOUT_HELP, "default: the preset's"))
    p.add_argument("--scheme", choices=("epochs", "random"), help="batch scheme (preset: epochs)")
    exit_statuses(p, RUN_EXIT)
    # None = not given: resuming refuses options that differ from the stored run (defaults applied in cmd_run)
    p.set_defaults(func=cmd_run, size=None, seed=None, device=None)


def add_stored_verbs(sub: argparse._SubParsersAction) -> None:
    """`status`, `report` and `resume`: the verbs on a stored run or sweep, named by its id."""
    id_help = "a run id or a sweep id (a folder name under DIR/runs/ or DIR/sweeps/)"
    p = sub.add_parser("status", help="where a run or a sweep stands; with no id, the recent runs and sweeps",
                       description="Print where a run or a sweep stands: a run's backends (completed, running, "
                       "interrupted, failed, not started, with the step reached), its paired timing and parity "
                       "verdict; a sweep's cells and paired timings. Without an id, list the recent runs and sweeps "
                       "of --out, newest first, as `git log` does (a sweep's cells under its sweep).")
    p.add_argument("id", nargs="?", metavar="ID", help=f"{id_help}; without it, the recent runs and sweeps, one "
                   "line each (id, kind, size, backends, state, verdict)")
    add_out(p, "default reports/; read only")
    p.add_argument("--last", type=positive_int, default=LAST, metavar="N",
                   help=f"without an ID: the N most recent runs and sweeps ({LAST})")
    add_json(p, "the table's rows")
    exit_statuses(p, {0: "printed, whatever the states"})
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("report", help="rebuild an HTML report from stored records: runs side by side, or a sweep",
                       description="Rebuild an HTML report from stored records: one run's, several runs' in one "
                       "comparison, or a sweep's; and the index.")
    p.add_argument("ids", nargs="+", metavar="ID", help=f"{id_help}; several run ids make one comparison report; or "
                   "the id of a `harness bench parts` record (DIR/bench/parts-....json): its page")
    add_out(p, "default reports/; the report and index.html are written there")
    exit_statuses(p, {0: "the report is written", 2: "bad input: a run or sweep missing or damaged (one line on "
                      "stderr, nothing written)"})
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("resume", help="continue an interrupted run, or run what a sweep has not completed",
                       description="Continue an interrupted run from its checkpoints, or run a sweep's pending, failed "
                       "and interrupted cells, each from its last checkpoint. Never a completed cell or one still "
                       "running.")
    p.add_argument("id", metavar="ID", help=id_help)
    add_out(p)
    add_threads(p, "a run: instead of the run's own (default: the run's)", default=None)
    add_paired(p, None)
    p.add_argument("--jobs", type=positive_int, metavar="N", help=shared(JOBS_HELP, "a sweep only"))
    p.add_argument("--no-wait", action="store_true", help=NO_WAIT_HELP)
    p.add_argument("--no-report", action="store_true", help=NO_REPORT_HELP)
    add_quiet(p)
    add_json(p, "as `harness run --json` or `harness sweep --json` (without it stdout holds the id)")
    exit_statuses(p, {0: "a run: every backend completed; a sweep: every cell completed (with --no-wait: submitted)",
                      1: "a backend or cell failed or was interrupted again, or a run's inputs differ",
                      2: "bad input (one line on stderr, nothing written), or the disk filled up"})
    p.set_defaults(func=cmd_resume)


def build_parser() -> Parser:
    """The parser of every command (tests/test_cli_vocabulary.py walks it)."""
    from harness import __version__
    from harness.cli import bench, kit, parity, sweep

    parser = Parser(prog="harness", description="Train the same character-level nanoGPT in every backend "
                    "(%(backends)s: each in its own process), with identical data and weights, and compare them: "
                    "whether and how far they agree, and how fast they are.")
    parser.add_argument("--version", action="version", version=f"nanogpt-parity {__version__}")
    exit_statuses(parser, {**HARNESS_EXIT, 0: "done: passed, completed, measured or printed (`harness COMMAND "
                                              "--help` lists each command's own statuses)"})
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    add_run(sub)

    p = sub.add_parser("parity", help="check that two backends compute the same thing, depth by depth",
                       description="Train two backends in parity mode (identical weights, batches and dropout "
                       "masks) and compare them depth by depth: the step-0 activation taps, logits and gradients, "
                       "every optimizer step re-synchronised, the loss curve; against measured tolerances "
                       "(docs/parity.md). The first place they differ is named, with its likely cause.")
    add_common(p, "one: parity checks one size at a time (default small)", one_size=True)
    parity.add_arguments(p)
    p.set_defaults(func=parity.command)

    p = sub.add_parser("sweep", help="many runs over sizes, backends, seeds and fields, locally or on SLURM",
                       description="Many ordinary runs (cells): the cross product of the axes, each cell validated "
                       "before anything is written, run one at a time here or as a SLURM job array; a report with "
                       "95 % intervals across seeds (docs/sweeps.md). `harness status|resume|report SWEEP_ID` "
                       "follow it.")
    sweep.add_arguments(p)
    p.set_defaults(func=sweep.command, write_report=write_sweep_report)

    add_stored_verbs(sub)

    p = sub.add_parser("bench", help="benchmarks: the harness's overhead, and speed verdicts under load",
                       description="`harness bench overhead`: is the harness part of what it measures? `harness bench "
                       "noise`: does a speed verdict survive other work on the machine?")
    bench.add_arguments(p)

    p = sub.add_parser("kit", help="a conformance kit for any nanoGPT port: export inputs and the oracle's answers, "
                       "check a port's results")
    kit.add_arguments(p)
    p.set_defaults(func=kit.command)

    add_helpers(sub)
    return parser


def add_helpers(sub: argparse._SubParsersAction) -> None:
    """The commands around the measurements: sizes, doctor, setup."""
    p = sub.add_parser("sizes", help="print the size presets")
    p.add_argument("--toml", choices=PRESETS, metavar="SIZE", help=f"print that preset's TOML file instead "
                   f"({', '.join(PRESETS)})")
    exit_statuses(p, {0: "printed"})
    p.set_defaults(func=cmd_sizes)

    p = sub.add_parser("doctor", help="report what each backend needs and finds installed here, and what to do about "
                       "what is missing")
    exit_statuses(p, {0: "printed (a report, not a check: also when something is missing)"})
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("setup", help="install and precompile optional parts ahead of time",
                       description="Install and precompile an optional part ahead of time (`harness setup julia`).")
    exit_statuses(p, SETUP_EXIT)
    parts = p.add_subparsers(dest="setup_command", required=True, metavar="julia", parser_class=Parser)
    j = parts.add_parser("julia", help="the Flux.jl environment: install, precompile and smoke-test it",
                         description="Install Flux.jl and the project's NanoGPTFlux package into juliapkg's "
                         "environment, precompile them and train one tiny step as a smoke test (docs/usage.md, "
                         "\"Julia support\").")
    j.add_argument("--force", action="store_true", help="re-resolve and re-precompile even if it looks done")
    exit_statuses(j, SETUP_EXIT)
    j.set_defaults(func=cmd_setup)


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
        from harness.store import os_error_message

        print(f"harness: error: {os_error_message(exc, 'cannot write')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
