"""`harness`: the command line. Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

from harness.cli.doctor import cmd_doctor, cmd_setup
from harness.cli.options import (
    DEFAULT_OUT,
    THREADS_HELP,
    Parser,
    add_backend,
    add_common,
    add_paired,
    add_quiet,
    add_schedule,
    out_arg,
    positive_int,
)
from harness.cli.report import cmd_report, write_sweep_report
from harness.cli.run import cmd_run
from harness.cli.sizes import cmd_sizes
from harness.config.presets import PRESETS, SIZES
from harness.errors import UsageError


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
    add_backend(p, "torch, numpy, jax, flux, or all (every backend that can run here); repeat or comma-separate, "
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

    from harness.cli import bench, parity

    p = sub.add_parser("parity", help="check that two backends compute the same thing, depth by depth")
    add_common(p, f"the size preset: one of {', '.join(PRESETS)} (default small; parity checks one size at a time)",
               per_backend_device=True, one_size=True)
    parity.add_arguments(p)
    p.set_defaults(func=parity.command)

    p = sub.add_parser("bench", help="measure harness overhead, bare-loop speed and batch-stream speed")
    bench.add_arguments(p)
    p.set_defaults(func=bench.command)

    from harness.cli import sweep

    p = sub.add_parser("sweep", help="many runs over sizes, backends, seeds and fields, locally or on SLURM")
    sweep.add_arguments(p)
    p.set_defaults(func=sweep.command, write_report=write_sweep_report)

    from harness.cli import kit

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
        from harness.run.records import os_error_message

        print(f"harness: error: {os_error_message(exc, 'cannot write')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
