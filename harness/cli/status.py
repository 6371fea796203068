"""`harness status [ID]`: where a run or a sweep stands (a run's backends, a sweep's cells), or, with no id, the
recent runs and sweeps of --out, one line each; read from --out only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

from harness.cli.options import print_json, stored_kind
from harness.errors import UsageError

LAST = 20  # the default of --last: how many runs and sweeps the listing shows
SWEEPS_READ = 50  # the most recent sweeps whose manifests are read, so that their cells are listed under them


def cmd_status(args: argparse.Namespace) -> int:
    """Print the status table of the run or sweep `args.id`, or the listing; 0 whatever the states (it reports, it
    does not judge)."""
    if args.id is None:
        return list_recent(Path(args.out), args.last, args.json)
    kind = stored_kind(args.out, args.id)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if kind == "sweep":
            from harness.sweep import manifest as mf
            from harness.sweep.state import print_status

            counted = print_status(mf.Manifest.load(args.out, args.id))  # reads only: its owner may be writing it
            result: dict = {"cells": counted}
        else:
            from harness.run.state import print_status as print_run_status
            from harness.store import RunPaths

            result = {"backends": print_run_status(RunPaths(Path(args.out), args.id))}
    if args.json:
        print_json("status", 0, id=args.id, kind=kind, out=str(args.out), **result)
    return 0


def names(folder: Path) -> list[str]:
    """The entries of `folder`, newest first (ids begin with their UTC time), [] when there is none."""
    try:
        with os.scandir(folder) as entries:
            return sorted((e.name for e in entries if not e.name.startswith(".")), reverse=True)
    except OSError:
        return []


def recent(out: Path, last: int) -> list[dict[str, str]]:
    """The `last` most recent runs and sweeps under `out`, newest first, one row each (harness.run.state.run_summary,
    harness.sweep.state.sweep_summary); a run that is a cell of one of the SWEEPS_READ most recent sweeps is left to
    its sweep's row; one that cannot be read is a row saying why, never an error."""
    from harness.run.state import run_summary
    from harness.store import RunPaths, SweepPaths
    from harness.sweep.state import sweep_summary

    rows: dict[str, dict[str, str]] = {}
    cells: set[str] = set()
    sweeps = names(SweepPaths.root(out))[:max(last, SWEEPS_READ)]
    for name in sweeps:
        try:
            rows[name], members = sweep_summary(out, name)
            cells |= members
        except (UsageError, OSError, ValueError) as exc:
            rows[name] = unreadable(name, "sweep", exc)
    runs = [n for n in names(RunPaths.root(out)) if n not in cells][:last]
    chosen = sorted([*sweeps[:last], *runs], reverse=True)[:last]
    for name in (n for n in chosen if n not in rows):  # only the runs shown are read
        try:
            rows[name] = run_summary(RunPaths(out, name))
        except (UsageError, OSError, ValueError, KeyError, TypeError) as exc:
            rows[name] = unreadable(name, "run", exc)
    return [rows[n] for n in chosen]


def unreadable(name: str, kind: str, exc: BaseException) -> dict[str, str]:
    """The row of a run or sweep that cannot be read: the first words of why."""
    why = " ".join(str(exc).split()).replace(f"/{name}'", f"{name}'")
    why = re.sub(rf"'[^']*?{re.escape(name)}'", f"'{name}'", why)  # the id, not its path: the reason fits the row
    return {"id": name, "kind": kind, "size": "?", "backends": "?", "state": "unreadable",
            "verdict": why[:80] + ("..." if len(why) > 80 else "")}


def list_recent(out: Path, last: int, as_json: bool) -> int:
    """`harness status` with no id: the listing (or, with `as_json`, its rows as JSON)."""
    from harness.units import text_table

    rows = recent(out, last)
    if as_json:
        print_json("status", 0, out=str(out), recent=rows)
        return 0
    if not rows:
        print(f"no runs or sweeps under {str(out)!r}; start one with `harness run`, or pass the --out they were "
              "written to", file=sys.stderr)
        return 0
    header = ("id", "kind", "size", "backends", "state", "verdict")
    print(text_table(header, [[row[k] for k in header] for row in rows]))
    print(f"the {len(rows)} most recent under {out}" + (" (--last N for more)" if len(rows) == last else "")
          + "; `harness status ID` for one of them", file=sys.stderr)
    return 0
