"""`harness report`: rebuild HTML reports from stored records.
"""

from __future__ import annotations

import argparse
from pathlib import Path


# --- report ------------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from harness.report import write_index, write_report
    from harness.run import records

    for run_id in args.run_ids:
        records.check_run_id(run_id)
    records.check_writable(args.out)
    for run_id in args.run_ids:
        records.load_run(args.out, run_id)  # a missing or corrupt record fails here, before anything is written
    path = write_report(args.out, args.run_ids)
    write_index(args.out)
    print(f"report: {path}")
    return 0


def write_sweep_report(out: Path, sweep_id: str) -> Path:
    """A sweep's HTML report and the index of `out` (handed to `harness sweep`, which sits below the reports)."""
    from harness.report import write_index
    from harness.report.sweep import write_sweep_report as write

    path = write(out, sweep_id)
    write_index(out)
    return path
