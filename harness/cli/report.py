"""`harness report ID...`: rebuild HTML reports from stored records: one run's, several runs' side by side, a
sweep's, or a `harness bench parts` record's page.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harness.cli.options import stored_kind
from harness.errors import UsageError


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild the report of the runs `args.ids` (one comparison report) or of the one sweep among them."""
    from harness.store import RunPaths, check_writable, load_run
    from harness.store.paired import PairedRecord
    from harness.store.parts import is_parts_id

    if any(is_parts_id(ident) for ident in args.ids):
        return report_parts(args)
    kinds = {ident: stored_kind(args.out, ident) for ident in args.ids}
    sweeps = [ident for ident, kind in kinds.items() if kind == "sweep"]
    if sweeps and len(args.ids) > 1:
        raise UsageError(f"{sweeps[0]} is a sweep: its report stands alone; pass one sweep id, or run ids only")
    if sweeps:
        from harness.sweep import drive

        print(f"report: {drive.report(args.out, sweeps[0], write_sweep_report)}")
        return 0
    check_writable(args.out)
    for run_id in args.ids:  # a missing or corrupt record fails here, before anything is written or imported
        paths = RunPaths(Path(args.out), run_id)
        load_run(paths)
        if os.path.lexists(paths.paired_timing):
            PairedRecord.load(paths.paired_timing)
    from harness.report import write_index, write_report

    path = write_report(args.out, args.ids)
    write_index(args.out)
    print(f"report: {path}")
    return 0


def report_parts(args: argparse.Namespace) -> int:
    """Rebuild the page of one `harness bench parts` record (`<out>/bench/<id>.html`) from the record."""
    from harness.bench.parts_page import write_page
    from harness.store import check_writable
    from harness.store.parts import PartsRecord, check_id

    if len(args.ids) > 1:
        raise UsageError(f"{args.ids[0]} ... : a parts record's page stands alone; pass one parts id")
    record = PartsRecord.load(check_id(args.out, args.ids[0]))  # a missing or damaged record: one line, no page
    check_writable(args.out)
    print(f"report: {write_page(record, Path(args.out), record.options.per_block)}")
    return 0


def write_sweep_report(out: Path, sweep_id: str) -> Path:
    """A sweep's HTML report and the index of `out` (handed to the sweep machinery, which sits below the reports)."""
    from harness.report import write_index
    from harness.report.sweep import write_sweep_report as write

    path = write(out, sweep_id)
    write_index(out)
    return path
