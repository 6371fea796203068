"""`harness resume ID`: continue an interrupted run from its checkpoints, or run what a sweep has not completed.
"""

from __future__ import annotations

import argparse

from harness.cli.options import stored_kind
from harness.errors import UsageError

# the options of `harness resume` that apply to one kind only
RUN_ONLY = {"threads": "--threads", "paired_rounds": "--paired-rounds"}
SWEEP_ONLY = {"jobs": "--jobs", "no_wait": "--no-wait"}


def cmd_resume(args: argparse.Namespace) -> int:
    """Resume the run or sweep `args.id`; the exit status is `harness run`'s or `harness sweep`'s."""
    kind = stored_kind(args.out, args.id)
    wrong = SWEEP_ONLY if kind == "run" else RUN_ONLY
    for dest, option in wrong.items():
        if getattr(args, dest) not in (None, False):
            raise UsageError(f"{option} applies to a {'sweep' if kind == 'run' else 'run'}, and {args.id} is a "
                             f"{kind}; drop {option}")
    if kind == "run":
        from harness.cli.run import resume_run

        return resume_run(args, args.id)
    from harness.cli.report import write_sweep_report
    from harness.cli.sweep import say_result
    from harness.sweep import drive

    return drive.resume(args.out, args.id, jobs=args.jobs, progress=not args.quiet, wait=not args.no_wait,
                        write_report=None if args.no_report else write_sweep_report, result=say_result("resume", args))
