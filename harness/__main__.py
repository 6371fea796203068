"""`python -m harness`: the `harness` command and, behind the hidden `--worker KIND` flag, every child process the
harness starts (pyperf's model: one program; `harness.run.processes.child_command` builds every child's command line).

    python -m harness --worker train RUN_DIR BACKEND [--resume] [--no-progress]   harness.run.worker
    python -m harness --worker timed RUN_DIR BACKEND WARMUP_S                     harness.run.timed
    python -m harness --worker paired RECORD                                      harness.run.paired_timing
    python -m harness --worker bench JOB_JSON                                     harness.bench.overhead
    python -m harness --worker parts JOB_JSON                                     harness.bench.parts_process

The child checks that its parent is still alive (and the worker passes the test hook's "start" point) before it
imports anything heavy (harness.run.child).
"""

from __future__ import annotations

import sys


def worker(argv: list[str]) -> int:
    """Run the child of kind `argv[0]` with the rest of `argv`; its exit status."""
    from harness.run import child

    kind, args = (argv[0], argv[1:]) if argv else ("", [])
    if kind not in child.KINDS:
        print(f"usage: python -m harness {child.WORKER_FLAG} {{{','.join(child.KINDS)}}} ARGS...", file=sys.stderr)
        return 2
    child.check_parent(kind)
    child.pause_at("start" if kind == "train" else f"{kind}-start")
    if kind == "train":
        from harness.run import worker as train

        return train.main(args)
    if kind == "timed":
        from harness.run import timed

        return timed.main(args)
    if kind == "paired":
        from harness.run import paired_timing

        return paired_timing.main(args)
    if kind == "parts":
        from harness.bench import parts_process

        return parts_process.main(args)
    from harness.bench import overhead

    return overhead.child_main(args)


if __name__ == "__main__":
    from harness.run.child import WORKER_FLAG

    if sys.argv[1:2] == [WORKER_FLAG]:
        sys.exit(worker(sys.argv[2:]))
    from harness.cli.main import main

    sys.exit(main())
