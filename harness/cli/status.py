"""`harness status ID`: where a run or a sweep stands (a run's backends, a sweep's cells), read from --out only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.options import stored_kind


def cmd_status(args: argparse.Namespace) -> int:
    """Print the status table of the run or sweep `args.id`; 0 whatever the states (it reports, it does not judge)."""
    if stored_kind(args.out, args.id) == "sweep":
        from harness.sweep import manifest as mf
        from harness.sweep.state import print_status

        print_status(mf.Manifest.load(args.out, args.id))  # reads only: the sweep's owner may be writing it
        return 0
    from harness.run.state import print_status as print_run_status
    from harness.store import RunPaths

    print_run_status(RunPaths(Path(args.out), args.id))
    return 0
